"""Parameter masks: selection at an exact density, save/load, density statistics. Training with a
mask (gradients zeroed, frozen coordinates bit-identical) is compute.train.optimizers.

A mask is `dict[str, BoolTensor]` keyed by parameter name, each the shape of its parameter;
True = the coordinate is trainable (kept). Density = kept coordinates / all coordinates of the
mask's tensors.

Selectors (`SELECTORS`):
- `fisher`           global top-k of the Fisher scores over all tensors
- `fisher-tensor`    top-k within each tensor (each tensor keeps the same density)
- `fisher-bottom`    global bottom-k of the Fisher scores
- `random`           uniform within each tensor, seeded per (seed, parameter name)
- `magnitude`        global top-k of |weight|
- `magnitude-bottom` global bottom-k of |weight|
- `gradient`         global top-k of |gradient| (pass the precomputed gradient dict as scores)

Exactness: k = round_half_up(density * N) coordinates over the N coordinates of all tensors; for
per-tensor selectors each tensor gets floor(density * n_t) and the rounding remainder goes to the
tensors with the largest fractional parts (ties: parameter name order), so the total is also k.
Ties in scores are broken by position: parameter names in sorted order, then flat index ascending
(the earlier coordinate wins for top-k and for bottom-k alike).

Global top-k never concatenates the model: the k-th value is found by a radix select on an
order-preserving 32-bit key of the float32 scores (two histogram passes over the tensors, one
tensor-sized temporary at a time), then ties at the threshold are resolved exactly in position
order.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from compute.lm.naming import layer_index, layer_label, module_type
from compute.runtime.control import cancel_point

SELECTORS = (
    "fisher",
    "fisher-tensor",
    "fisher-bottom",
    "random",
    "magnitude",
    "magnitude-bottom",
    "gradient",
)
# selector -> (score source, direction, scope)
_SELECTOR_RULES: dict[str, tuple[str, str, str]] = {
    "fisher": ("scores", "top", "global"),
    "fisher-tensor": ("scores", "top", "tensor"),
    "fisher-bottom": ("scores", "bottom", "global"),
    "random": ("random", "top", "tensor"),
    "magnitude": ("weights", "top", "global"),
    "magnitude-bottom": ("weights", "bottom", "global"),
    "gradient": ("scores", "top", "global"),
}

Mask = dict[str, torch.Tensor]


# ---------------------------------------------------------------------------------------------
# Exact top-k / bottom-k over a dict of tensors
# ---------------------------------------------------------------------------------------------


def _ordered_key(x: torch.Tensor, bottom: bool) -> torch.Tensor:
    """int64 key with the same order as float32 `x` (bottom=True reverses it). -0.0 == +0.0."""
    bits = x.detach().to(torch.float32).contiguous().view(torch.int32).to(torch.int64)
    # Non-negative floats order like their bit patterns; negative ones in reverse.
    key = torch.where(bits >= 0, bits, -(bits & 0x7FFFFFFF))
    return -key if bottom else key


def round_half_up(x: float) -> int:
    return int(math.floor(x + 0.5))


def n_keep(density: float, total: int) -> int:
    """Number of coordinates kept at `density` of `total` (round half up)."""
    return round_half_up(density * total)


def _check_finite(scores: Mapping[str, torch.Tensor]) -> None:
    for name, s in scores.items():
        if s.is_floating_point() and any(bool(torch.isnan(c).any()) for c in _slices(s)):
            raise ValueError(f"scores: NaN values in {name!r}; cannot rank them")


# values per slice of a tensor's keys (issue 30: an 8B model's embedding is 622M values, and a
# whole tensor's int64 keys and their temporaries were about 20 bytes a value of it)
KEY_CHUNK = 1 << 20


def _slices(t: torch.Tensor) -> list[torch.Tensor]:
    """Flat slices of at most KEY_CHUNK values, in order (views: no copy)."""
    flat = t.detach().reshape(-1)
    return [flat[o:o + KEY_CHUNK] for o in range(0, flat.numel(), KEY_CHUNK)]


def take_ties(m: torch.Tensor, eq: torch.Tensor, need: int) -> int:
    """Set in bool `m` the first `need` positions (ascending, flat) where `eq` holds, or all of
    them when there are no more; return how many are still needed (the order rule of every exact
    top-k here: compute.fisher.statistics' sets too)."""
    n_eq = int(eq.sum())
    if n_eq <= need:
        m |= eq
        return need - n_eq
    m[torch.nonzero(eq).flatten()[:need]] = True
    return 0


def topk_mask(
    scores: Mapping[str, torch.Tensor], k: int, *, bottom: bool = False, progress: Any = None
) -> Mask:
    """Exactly k coordinates with the largest (bottom=True: smallest) scores over all tensors.

    scores: name -> tensor of any shape (float32/bf16/fp16/float64 cast to float32 for ranking).
    Ties broken by (sorted parameter name, flat index) ascending. Returns name -> bool tensor.
    Temporaries: slices of KEY_CHUNK values, never a whole tensor's keys. `progress(fraction)`
    hears of each tensor of its three passes (an 8B model's selection is a minute on a CPU).
    """
    names = sorted(scores)
    total = sum(scores[n].numel() for n in names)
    seen = [0]

    def tick() -> None:  # after each tensor of each pass
        if progress is not None:
            progress(min(1.0, seen[0] / (3 * max(1, total))))
    if not 0 <= k <= total:
        raise ValueError(f"k: {k} outside [0, {total}]")
    if k == 0:
        return {n: torch.zeros_like(scores[n], dtype=torch.bool) for n in scores}
    if k == total:
        return {n: torch.ones_like(scores[n], dtype=torch.bool) for n in scores}

    # Radix select on the unsigned 32-bit key: the high 16 bits, then the low 16 bits within the
    # bin holding the k-th largest. Two counting passes, 65536 bins each.
    hist = torch.zeros(65536, dtype=torch.int64)
    for n in names:
        cancel_point()  # per tensor: a cancel stops a selection over many tensors within one
        for c in _slices(scores[n]):
            u = _ordered_key(c, bottom) + 2**31  # in [0, 2**32)
            hist += torch.bincount(u >> 16, minlength=65536).cpu()
        seen[0] += scores[n].numel()
        tick()
    hi_bin, above_hi = _kth_bin(hist, k)
    hist.zero_()
    for n in names:
        cancel_point()
        for c in _slices(scores[n]):
            u = _ordered_key(c, bottom) + 2**31
            hist += torch.bincount(u[(u >> 16) == hi_bin] & 0xFFFF, minlength=65536).cpu()
        seen[0] += scores[n].numel()
        tick()
    lo_bin, above_lo = _kth_bin(hist, k - above_hi)
    threshold = ((hi_bin << 16) | lo_bin) - 2**31  # the k-th largest key
    n_above = above_hi + above_lo
    need_ties = k - n_above  # >= 1: how many coordinates equal to the threshold to take, in order
    out: Mask = {}
    for n in names:
        cancel_point()
        m = torch.empty(scores[n].shape, dtype=torch.bool, device=scores[n].device)
        for c, mc in zip(_slices(scores[n]), _slices(m), strict=True):
            key = _ordered_key(c, bottom)
            torch.gt(key, threshold, out=mc)
            if need_ties > 0:
                need_ties = take_ties(mc, key == threshold, need_ties)
        out[n] = m
        seen[0] += scores[n].numel()
        tick()
    return {n: out[n] for n in scores}  # caller's key order


def _kth_bin(hist: torch.Tensor, k: int) -> tuple[int, int]:
    """Bin holding the k-th largest element of a histogram, and how many lie in higher bins."""
    from_top = torch.cumsum(hist.flip(0), 0)  # from_top[j] = count in bins >= 65535 - j
    j = int(torch.searchsorted(from_top, torch.tensor([k]), right=False)[0])
    b = 65535 - j
    above = int(from_top[j - 1]) if j > 0 else 0
    return b, above


def per_tensor_counts(shapes: Mapping[str, torch.Size | tuple[int, ...]], density: float) -> dict[str, int]:
    """Largest-remainder allocation: sum equals n_keep(density, total); each k_t ~ density * n_t."""
    names = sorted(shapes)
    sizes = {n: math.prod(shapes[n]) for n in names}
    total = sum(sizes.values())
    k = n_keep(density, total)
    base = {n: math.floor(density * sizes[n]) for n in names}
    # Floating error can make floor(density*n) exceed the exact value only by rounding; clamp.
    base = {n: min(b, sizes[n]) for n, b in base.items()}
    rest = k - sum(base.values())
    frac = sorted(names, key=lambda n: (-(density * sizes[n] - base[n]), n))
    i = 0
    while rest > 0:
        n = frac[i % len(frac)]
        if base[n] < sizes[n]:
            base[n] += 1
            rest -= 1
        i += 1
    while rest < 0:  # only from float error; remove from the smallest fractional parts
        n = frac[-1 - (i % len(frac))]
        if base[n] > 0:
            base[n] -= 1
            rest += 1
        i += 1
    return base


def _name_seed(seed: int, name: str) -> int:
    return (int(seed) * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


def random_mask(shapes: Mapping[str, torch.Size | tuple[int, ...]], density: float, seed: int = 0,
                device: torch.device | str | None = None) -> Mask:
    """Uniform random subset within each tensor (exact per-tensor counts), seeded per name."""
    counts = per_tensor_counts(shapes, density)
    out: Mask = {}
    for n, shape in shapes.items():
        numel = math.prod(shape)
        g = torch.Generator().manual_seed(_name_seed(seed, n))
        flat = torch.zeros(numel, dtype=torch.bool)
        flat[torch.randperm(numel, generator=g)[: counts[n]]] = True
        out[n] = flat.view(tuple(shape)).to(device or "cpu")
    return out


# ---------------------------------------------------------------------------------------------
# Selection entry point
# ---------------------------------------------------------------------------------------------


def trainable_params(model_or_params: Any) -> dict[str, torch.Tensor]:
    """name -> parameter for an nn.Module (trainable only, tied weights once) or a dict as is."""
    if model_or_params is None:
        return {}
    if isinstance(model_or_params, torch.nn.Module):
        return {n: p for n, p in model_or_params.named_parameters() if p.requires_grad}
    return dict(model_or_params)


def select_mask(
    selector: Any,
    density: Any,
    scores: Any = None,
    params: Any = None,
    seed: int = 0,
    *,
    model: Any = None,
    progress: Any = None,
) -> Mask:
    """Boolean mask keeping exactly round(density * N) of the N coordinates.

    selector: one of SELECTORS. density: in (0, 1].
    scores: name -> tensor (Fisher for fisher*, |gradient| or gradient for `gradient`).
    params / model: nn.Module or name -> tensor (needed by magnitude*, and by random when no
    scores are given). The tensor set is the scores' keys if given, else the trainable params.
    Also accepts the older call order select_mask(scores, selector, density, model, seed).
    progress(fraction): told as the selection goes (topk_mask's passes, tensor by tensor).
    """
    if isinstance(selector, Mapping):  # select_mask(scores, selector, density, model=None, seed=0)
        selector, density, scores, params = density, scores, selector, params
    if model is not None and params is None:
        params = model
    if selector not in _SELECTOR_RULES:
        raise ValueError(f"select: got {selector!r}; accepted: {', '.join(SELECTORS)}")
    if not isinstance(density, (int, float)) or not 0.0 < float(density) <= 1.0:
        raise ValueError(f"density: got {density!r}; accepted range: > 0, <= 1")
    density = float(density)
    source, direction, scope = _SELECTOR_RULES[selector]
    weights = trainable_params(params)

    if source == "scores":
        if not scores:
            raise ValueError(f"fisher: selector {selector!r} needs scores (a Fisher or gradient dict)")
        ranked = {n: (s.abs() if selector == "gradient" else s) for n, s in scores.items()}
        if weights:
            check_same_shapes(ranked, weights, "scores", "model")
    elif source == "weights":
        if not weights:
            raise ValueError(f"model: selector {selector!r} needs the model's weights")
        ranked = {n: w.detach().abs() for n, w in weights.items()}
    else:  # random
        ref = scores if scores else weights
        if not ref:
            raise ValueError("model: selector 'random' needs the model (or scores) for tensor shapes")
        device = next(iter(ref.values())).device
        return random_mask({n: t.shape for n, t in ref.items()}, density, seed, device)

    _check_finite(ranked)
    total = sum(t.numel() for t in ranked.values())
    k = n_keep(density, total)
    if k == 0:
        raise ValueError(f"density: {density} keeps 0 of {total} coordinates; use >= {1 / total:.3g}")
    bottom = direction == "bottom"
    if scope == "global":
        return topk_mask(ranked, k, bottom=bottom, progress=progress)
    counts = per_tensor_counts({n: t.shape for n, t in ranked.items()}, density)
    out: Mask = {}
    for i, (n, t) in enumerate(ranked.items()):
        out[n] = topk_mask({n: t}, counts[n], bottom=bottom)[n]
        if progress is not None:
            progress((i + 1) / len(ranked))
    return out


# ---------------------------------------------------------------------------------------------
# Validation, save / load
# ---------------------------------------------------------------------------------------------


def check_same_shapes(
    a: Mapping[str, Any], b: Mapping[str, Any], a_name: str = "mask", b_name: str = "model"
) -> None:
    """ValueError naming the first parameter missing on either side or with a different shape
    (compute.contract.shapes.mismatch, the rule submit checks with)."""
    from compute.contract.shapes import mismatch, shapes_of

    why = mismatch(shapes_of(a), shapes_of(b), f"the {a_name}", f"the {b_name}", both=True)
    if why:
        raise ValueError(f"{a_name}: {why}")


def save_mask(mask: Mapping[str, torch.Tensor], path: str | Path,
              metadata: Mapping[str, Any] | None = None) -> Path:
    """Write a boolean safetensors file (atomically: temp file + rename), one tensor at a time:
    a CompactMask is made dense a tensor at a time as it is written (issue 30: the job never holds
    the whole mask dense). Read back by safetensors' load_file / safe_open like any file."""
    import json

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    names = sorted(mask)  # safetensors' own order for tensors of one dtype
    shapes = {n: _mask_shape(mask, n) for n in names}
    meta = {"format": "fisherlens-mask", "density": repr(mask_density(mask))}
    meta.update({k: str(v) for k, v in (metadata or {}).items()})
    header: dict[str, Any] = {"__metadata__": meta}
    offset = 0
    for n in names:
        size = math.prod(shapes[n])
        header[n] = {"dtype": "BOOL", "shape": list(shapes[n]), "data_offsets": [offset, offset + size]}
        offset += size
    head = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(len(head).to_bytes(8, "little"))
        f.write(head)
        for n in names:
            t = mask[n].detach().to("cpu", torch.bool).contiguous().reshape(-1)
            if tuple(mask[n].shape) != shapes[n]:
                raise ValueError(f"mask: tensor {n!r} changed shape while being written")
            f.write(t.view(torch.uint8).numpy().tobytes())
            del t
    tmp.replace(path)
    return path


def _mask_shape(mask: Mapping[str, torch.Tensor], name: str) -> tuple[int, ...]:
    return mask.shape_of(name) if isinstance(mask, CompactMask) else tuple(mask[name].shape)


def load_mask(path: str | Path, model: Any = None, device: torch.device | str | None = None) -> Mask:
    """Read a mask; with `model` (nn.Module or name -> tensor) check names and shapes match its
    trainable parameters (ValueError naming the first mismatch)."""
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"mask: file not found: {path}")
    mask = load_file(str(path), device=str(device) if device else "cpu")
    for n, m in mask.items():
        if m.dtype != torch.bool:
            raise ValueError(f"mask: tensor {n!r} in {path} has dtype {m.dtype}, expected bool")
    if model is not None:
        check_same_shapes(mask, trainable_params(model), "mask", "model")
    return mask


def load_compact_mask(path: str | Path, model: Any = None,
                      device: torch.device | str | None = None) -> CompactMask:
    """load_mask's file as a CompactMask, read one tensor at a time (safe_open): no dense copy of
    the whole mask is ever alive. Same checks and errors as load_mask."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"mask: file not found: {path}")
    out = CompactMask(device)
    with safe_open(str(path), framework="pt", device="cpu") as f:
        shapes = {}
        for n in f.keys():  # noqa: SIM118 (safe_open has keys(), no __iter__)
            sl = f.get_slice(n)
            if sl.get_dtype() != "BOOL":
                dt = f.get_tensor(n).dtype
                raise ValueError(f"mask: tensor {n!r} in {path} has dtype {dt}, expected bool")
            shapes[n] = tuple(sl.get_shape())
        if model is not None:
            check_same_shapes({n: torch.empty(s, device="meta") for n, s in shapes.items()},
                              trainable_params(model), "mask", "model")
    for n, shape in shapes.items():
        out.add_rows(n, shape, lambda r0, r1, n=n: _read_rows(path, n, r0, r1))
    return out


MASK_READ_CHUNK = 1 << 22  # values of a mask tensor read at once (4 MiB of bools)


def _read_rows(path: Path, name: str, r0: int, r1: int) -> torch.Tensor:
    """Rows r0..r1-1 of one tensor of a safetensors file, from a mapping opened for them alone:
    its pages leave the process when it closes (a mapping held for the whole file kept every page
    read, 1 byte/param of the mask: the 360M masked job's peak, issue 30)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt", device="cpu") as f:
        sl = f.get_slice(name)
        if not sl.get_shape():
            return f.get_tensor(name)
        return sl[r0:r1]


class CompactMask(Mapping[str, torch.Tensor]):
    """A mask held in its compact form (issue 30: memory in proportion to the mask): per tensor,
    True (every coordinate kept), False (none) or the sorted flat indices of the kept coordinates
    (int32 below 2^31 elements, else int64; the `Coords` of compute.train.optimizers). Reading a
    tensor (`mask[name]`, items()) builds its dense bool tensor, one at a time, on `device`; so
    any code that reads a mask tensor by tensor (restrict, mask_density, save_mask) works on it
    unchanged without the whole mask ever being dense."""

    def __init__(self, device: torch.device | str | None = None):
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._shape: dict[str, tuple[int, ...]] = {}
        self._part: dict[str, bool | torch.Tensor] = {}

    @classmethod
    def of(cls, mask: Mapping[str, torch.Tensor], device: torch.device | str | None = None) -> CompactMask:
        """The compact form of a mask (bool tensors, or a CompactMask moved to `device`)."""
        if isinstance(mask, CompactMask) and (device is None or torch.device(device) == mask.device):
            return mask
        out = cls(device if device is not None else
                  (mask.device if isinstance(mask, CompactMask) else None))
        for n in mask:
            out.add(n, mask[n])
        return out

    def add(self, name: str, m: torch.Tensor) -> None:
        """Add (or replace) one tensor of the mask from its dense bool form."""
        m = m.bool()
        self.add_rows(name, tuple(m.shape), lambda r0, r1: m[r0:r1] if m.dim() else m)

    def add_rows(self, name: str, shape: tuple[int, ...], read: Any) -> None:
        """Add one tensor of the mask from its dense bool rows, read `read(r0, r1)` a chunk of
        rows (MASK_READ_CHUNK values) at a time: the tensor is never whole in memory (a file's
        dtype is checked from its header by load_compact_mask)."""
        numel = math.prod(shape)
        row = math.prod(shape[1:]) if shape else 1
        step = max(1, MASK_READ_CHUNK // max(row, 1))
        dt = torch.int32 if numel < 2**31 else torch.int64
        parts = []
        for r0 in range(0, shape[0] if shape else 1, step):
            m = read(r0, r0 + step).reshape(-1)
            parts.append((torch.nonzero(m).reshape(-1) + r0 * row).to(dtype=dt, device=self.device))
        idx = torch.cat(parts) if parts else torch.empty(0, dtype=dt, device=self.device)
        self._shape[name] = tuple(shape)
        self._part[name] = True if idx.numel() == numel else False if idx.numel() == 0 else idx

    def part(self, name: str) -> bool | torch.Tensor:
        """True (all kept), False (none) or the sorted flat indices of the kept coordinates."""
        return self._part[name]

    def shape_of(self, name: str) -> tuple[int, ...]:
        return self._shape[name]

    def kept(self, name: str) -> int:
        p = self._part[name]
        if isinstance(p, bool):
            return math.prod(self._shape[name]) if p else 0
        return int(p.numel())

    def density(self) -> float:
        total = sum(math.prod(s) for s in self._shape.values())
        return sum(self.kept(n) for n in self._shape) / total if total else 0.0

    def nbytes(self) -> int:
        """Bytes of the index tensors (what holding this mask costs)."""
        return sum(p.numel() * p.element_size() for p in self._part.values() if isinstance(p, torch.Tensor))

    def __getitem__(self, name: str) -> torch.Tensor:
        shape, p = self._shape[name], self._part[name]
        if isinstance(p, bool):
            return (torch.ones if p else torch.zeros)(shape, dtype=torch.bool, device=self.device)
        out = torch.zeros(math.prod(shape), dtype=torch.bool, device=self.device)
        out.index_put_((p,), torch.ones((), dtype=torch.bool, device=self.device))
        return out.view(shape)

    def __iter__(self) -> Any:
        return iter(self._shape)

    def __len__(self) -> int:
        return len(self._shape)

    def __contains__(self, name: object) -> bool:
        return name in self._shape


def mask_metadata(path: str | Path) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata() or {})


# ---------------------------------------------------------------------------------------------
# Density statistics
# ---------------------------------------------------------------------------------------------


def mask_density(mask: Mapping[str, torch.Tensor]) -> float:
    if isinstance(mask, CompactMask):
        return mask.density()
    total = sum(m.numel() for m in mask.values())
    return sum(int(m.sum()) for m in mask.values()) / total if total else 0.0


def group_key(name: str, by: str) -> str:
    """Group label of a parameter: by 'tensor', 'layer', 'module', 'layer_module' or 'global'."""
    if by == "tensor":
        return name
    if by == "layer":
        return layer_label(layer_index(name))
    if by == "module":
        return module_type(name)
    if by == "layer_module":
        return f"{layer_label(layer_index(name))}/{module_type(name)}"
    if by == "global":
        return "all"
    raise ValueError(f"by: got {by!r}; accepted: tensor, layer, module, layer_module, global")


def density_by(mask: Mapping[str, torch.Tensor], by: str = "tensor") -> dict[str, dict[str, float]]:
    """group -> {"kept", "total", "density"} (counts as floats for JSON)."""
    acc: dict[str, list[int]] = {}
    for n, m in mask.items():
        g = acc.setdefault(group_key(n, by), [0, 0])
        g[0] += int(m.sum())
        g[1] += m.numel()
    return {k: {"kept": float(a), "total": float(t), "density": a / t if t else 0.0}
            for k, (a, t) in acc.items()}
