"""A run folder as a series: update sparsity over training, step to step, and what a sparse
synchronisation of each step would send.

A run folder is what TRL and the HF Trainer write with `save_steps` (and `fisherlens train
--save-steps N`): RUN_DIR/checkpoint-<step>/ with model.safetensors (or shards and
model.safetensors.index.json), config.json, trainer_state.json, optimizer.pt, ... For every
checkpoint, in step order, and for two pairs of weights:

- `vs_base`: the checkpoint against the base model (the cumulative update);
- `vs_prev`: the checkpoint against the previous one (the base for the first): one step's update,

per tensor, then summed per layer, module type, layer x module and globally (compute.sparsity.masks.group_key),
the counts of compute.sparsity.diff with the same names and definitions (docs/science.md section 6):

- `unchanged_exact`: equal in the stored dtype (`update_sparsity` is its fraction);
- `unchanged_bf16`: equal after casting both to bfloat16;
- `unchanged_atol_<a>`: |delta_fp32| <= a, delta = cur.float32 - ref.float32;
- `unchanged_bf16delta_atol_<a>`: the published convention (sparsity_in_rl, arXiv 2505.11711): both
  loaded in bfloat16, |cur_bf16 - ref_bf16| <= a computed in bfloat16;
- `delta_rms`, `max_abs_delta` of the float32 delta;

and what synchronising that update would send (bytes; the receiver holds the previous weights):

- `dense_bytes` = numel x itemsize of the checkpoint's dtype;
- `sparse_bytes` = changed x (index bytes + itemsize): indices + values of the changed coordinates,
  an int32 flat index per coordinate (int64 for tensors of 2^31 or more elements);

With a Fisher (the initial one: of the base, or of the run's start), its global top-k
(`support_percent` of its coordinates, compute.sparsity.masks.topk_mask: exact k, ties by position) is a fixed
support S both sides know, chosen once:

- `support_bytes` = |S| x itemsize: values only, on S, every step;
- `support_changed` = |S & changed|; `precision_at_k` = |S & changed| / |S| (compute.sparsity.overlap's
  precision@k with the changed set as target); `captured_count_share` = |S & changed| / |changed|
  and `captured_sq_share` = sum_S delta^2 / sum delta^2: the share of the step's update, by count
  and by squared mass, that a values-only sync on S carries (the rest is lost);
- `auc`: ROC-AUC of the Fisher for "changed" (compute.sparsity.overlap.roc_auc, ties one half), on a seeded
  sample of `auc_cap` coordinates when the Fisher is larger, exactly as compute.sparsity.overlap.score_vs_target
  samples them.

Order, memory, time: name by name, every checkpoint in step order, so each tensor is read once
(one pread from its safetensors file into one of three reusable buffers: the base's, the previous
checkpoint's, the current one's; no mapping kept). In memory: those three tensors of one name, the
support's flat indices (|S| int64), the AUC sample's indices and its 2 x mid-ranks per grouping
(<= auc_cap x (8 + 16) bytes) and a few numbers per tensor and checkpoint. The counts of a pair,
and the Fisher's share of a point, are one C loop each (compute.sparsity.series_kernel, built with the system
compiler on first use; without one, numpy sweeps in cache-sized chunks with the same counts):
benchmarks/bench_series.py measures a point against reading its tensors and the previous ones.
"""

from __future__ import annotations

import functools
import gc
import json
import math
import os
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from compute.contract import precision
from compute.contract.jobresult import null_progress
from compute.sparsity import series_kernel
from compute.sparsity.masks import group_key, n_keep, topk_mask
from compute.sparsity.overlap import DEFAULT_CAP, midranks, round_half_up_ratio, sample_index

CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
GROUPINGS = ("global", "layer", "module", "layer_module")
PAIRS = ("vs_base", "vs_prev")
CHUNK = 1 << 16  # elements per cache-resident chunk (256 KiB of float32 per buffer)


@dataclass(frozen=True)
class SeriesConfig:
    atol: float = field(default=1e-5, metadata={
        "help": "absolute tolerance of the two delta conventions (|delta| <= atol counts as unchanged)"})
    support_percent: float = field(default=1.0, metadata={
        "help": "Fisher top-k% that forms the fixed sync support (and precision@k)"})
    auc_cap: int = field(default=DEFAULT_CAP, metadata={
        "help": "coordinates the Fisher AUC ranks; above it a seeded sample (compute.sparsity.overlap)"})
    seed: int = field(default=0, metadata={"help": "seed of the AUC sample"})

    def __post_init__(self) -> None:
        if not (isinstance(self.atol, (int, float)) and 0 < self.atol <= 1):
            raise ValueError(f"atol: got {self.atol!r}; accepted range: > 0, <= 1")
        if not 0 < self.support_percent <= 100:
            raise ValueError(f"support_percent: got {self.support_percent!r}; accepted range: > 0, <= 100")
        if not 1000 <= self.auc_cap <= 100_000_000:
            raise ValueError(f"auc_cap: got {self.auc_cap!r}; accepted range: 1000 .. 100000000")


# ---------------------------------------------------------------------------------------------
# The run folder
# ---------------------------------------------------------------------------------------------


@dataclass
class RunCheckpoint:
    step: int
    folder: Path
    source: Any  # compute.sparsity.diff.Checkpoint (or any object with names/shape/dtype/get)
    trainer: dict[str, Any] = field(default_factory=dict)  # global_step, the step's log entry

    @property
    def name(self) -> str:
        return self.folder.name


def find_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, folder) of every checkpoint-<step> subfolder, by step. ValueError (naming `run_dir`)
    for a missing folder, no checkpoint, a checkpoint-* entry that is not a checkpoint-<digits>
    folder, or two folders of one step."""
    root = Path(run_dir)
    if not root.is_dir():
        raise ValueError(f"run_dir: {run_dir} is not a directory")
    found: dict[int, Path] = {}
    for entry in sorted(root.iterdir()):
        if not entry.name.startswith("checkpoint-"):
            continue
        m = CHECKPOINT_RE.match(entry.name)
        if not m:
            raise ValueError(f"run_dir: {entry.name!r} in {run_dir} is not a checkpoint-<step> folder "
                             "(step in digits); rename or remove it")
        if not entry.is_dir():
            raise ValueError(f"run_dir: {entry.name} in {run_dir} is a file, not a checkpoint folder")
        step = int(m.group(1))
        if step in found:
            raise ValueError(f"run_dir: {found[step].name} and {entry.name} in {run_dir} are both step {step}")
        found[step] = entry
    if not found:
        others = sorted(e.name for e in root.iterdir())[:8]
        raise ValueError(f"run_dir: no checkpoint-<step> folder in {run_dir} (a TRL / HF Trainer output_dir "
                         f"saved with save_steps, or fisherlens train --save-steps); it holds: "
                         f"{', '.join(others) if others else 'nothing'}")
    return sorted(found.items())


def _trainer_info(folder: Path, step: int) -> dict[str, Any]:
    """global_step and the numbers logged at this step, from trainer_state.json (when present)."""
    f = folder / "trainer_state.json"
    if not f.is_file():
        return {}
    try:
        state = json.loads(f.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"run_dir: {folder.name}/trainer_state.json is not JSON ({exc})") from None
    out: dict[str, Any] = {"global_step": state.get("global_step")}
    log: dict[str, float] = {}
    for entry in state.get("log_history", []):
        if entry.get("step") == step:
            log.update({k: float(v) for k, v in entry.items()
                        if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"})
    out["log"] = log
    if out["global_step"] is not None and out["global_step"] != step:
        out["note"] = f"trainer_state.json says global_step {out['global_step']}, the folder says {step}"
    return out


def open_run(run_dir: str | Path) -> list[RunCheckpoint]:
    """Every checkpoint of a run folder, its weights' headers read (not the tensors)."""
    from compute.sparsity.diff import Checkpoint

    out = []
    for step, folder in find_checkpoints(run_dir):
        try:
            src = Checkpoint(folder, f"run_dir: {folder.name}")
        except ValueError as exc:
            raise ValueError(str(exc)) from None
        out.append(RunCheckpoint(step, folder, src, _trainer_info(folder, step)))
    return out


def check_run_fits(base: Any, run: Sequence[RunCheckpoint]) -> list[str]:
    """The float tensor names shared by the base and every checkpoint; ValueError naming the first
    checkpoint and parameter missing on one side or of another shape."""
    names = set(base.names())
    for ck in run:
        other = set(ck.source.names())
        for n in sorted(names | other):
            if n not in other:
                raise ValueError(f"run_dir: {ck.name}: parameter {n!r} is in the base but not in this "
                                 "checkpoint (another architecture, or the base is not this run's start)")
            if n not in names:
                raise ValueError(f"run_dir: {ck.name}: parameter {n!r} is in this checkpoint but not in "
                                 "the base (another architecture, or the base is not this run's start)")
            if tuple(base.shape(n)) != tuple(ck.source.shape(n)):
                raise ValueError(f"run_dir: {ck.name}: parameter {n!r} has shape {list(ck.source.shape(n))} "
                                 f"but {list(base.shape(n))} in the base")
    return sorted(names)


# ---------------------------------------------------------------------------------------------
# A lazily read Fisher
# ---------------------------------------------------------------------------------------------


class LazyTensors(Mapping[str, torch.Tensor]):
    """The floating tensors of a safetensors file, read (as float32) on each access."""

    def __init__(self, path: str | Path, label: str = "fisher"):
        from safetensors import safe_open

        self.path, self.label = Path(path), label
        self._shapes: dict[str, tuple[int, ...]] = {}
        try:
            with safe_open(str(self.path), framework="pt") as h:
                for n in h.keys():  # noqa: SIM118 - safe_open handles are not dicts
                    sl = h.get_slice(n)
                    if str(sl.get_dtype()).upper().startswith(("F", "BF")):
                        self._shapes[n] = tuple(sl.get_shape())
        except Exception as exc:  # noqa: BLE001 - any parse error is a user error about this file
            raise ValueError(f"{label}: cannot read {path} as safetensors ({type(exc).__name__}: {exc})") from None
        if not self._shapes:
            raise ValueError(f"{label}: {path} holds no floating-point tensors")

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        if name not in self._shapes:
            raise KeyError(name)
        with safe_open(str(self.path), framework="pt") as h:
            return h.get_tensor(name).float()

    def __iter__(self) -> Iterator[str]:
        return iter(self._shapes)

    def __len__(self) -> int:
        return len(self._shapes)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]


def _fisher_shape(fisher: Mapping[str, torch.Tensor], name: str) -> tuple[int, ...]:
    return fisher.shape(name) if isinstance(fisher, LazyTensors) else tuple(fisher[name].shape)


@dataclass
class _FisherPlan:
    """What the series needs of the Fisher, computed once: the support's flat indices per tensor,
    the AUC sample's indices per tensor (None = every coordinate) and the Fisher's mid-ranks per
    group of the sample (the score is fixed, only the labels change from point to point).

    The sample's indices are sorted (gathers walk memory forward; the ranks are permuted with
    them, so every rank sum, hence every AUC, is the same), and each tensor keeps its slice of
    its groups' mid-ranks, doubled (integers), as one (m, len(GROUPINGS)) int32 matrix: a point's
    rank sums over the changed coordinates are then exact integer sums (compute.sparsity.series_kernel's
    fisher_pair, or one float64 matrix-vector product per tensor and pair, exact below 2^53)."""

    names: list[str]
    k: int
    total: int
    support: dict[str, torch.Tensor]  # name -> int64 flat indices of S in that tensor (sorted)
    sample: dict[str, torch.Tensor | None]  # name -> sorted int64 indices (None: every coordinate)
    rank_cols: dict[str, torch.Tensor]  # name -> (m, len(GROUPINGS)) int32: 2 x mid-ranks in its groups
    members: dict[str, dict[str, list[str]]]  # grouping -> group -> names (in self.names order)
    sampled: bool
    auc_n: int  # coordinates the AUC ranks


def plan_fisher(fisher: Mapping[str, torch.Tensor], base: Any, config: SeriesConfig,
                within: Mapping[str, torch.Tensor] | None = None) -> _FisherPlan:
    """Check the Fisher against the base, select its top-k support, draw the AUC sample.
    within: the mask the run trained inside (compute.contract.construction): the support, the AUC
    sample and every Fisher share are taken over its coordinates (the ones free to move) only."""
    base_names = set(base.names())
    names = list(fisher)
    for n in names:
        if n not in base_names:
            raise ValueError(f"fisher: parameter {n!r} is not in the base model")
        if _fisher_shape(fisher, n) != tuple(base.shape(n)):
            raise ValueError(f"fisher: parameter {n!r} has shape {list(_fisher_shape(fisher, n))} "
                             f"but {list(base.shape(n))} in the base model")
    inside: dict[str, torch.Tensor] | None = None  # name -> sorted flat indices inside the mask
    if within is not None:
        inside = {n: torch.nonzero(within[n].flatten().bool()).flatten() for n in names if n in within}
        inside = {n: ix for n, ix in inside.items() if ix.numel()}
        names = [n for n in names if n in inside]
        if not names:
            raise ValueError("mask: no coordinate of the Fisher is inside the mask the run was trained in")
    size = {n: int(inside[n].numel()) if inside is not None else math.prod(_fisher_shape(fisher, n))
            for n in names}
    total = sum(size.values())
    k = n_keep(config.support_percent / 100.0, total)
    if k == 0:
        raise ValueError(f"support_percent: {config.support_percent:g}% keeps 0 of {total} coordinates")
    if inside is None:
        mask = topk_mask(fisher, k)
        support = {n: torch.nonzero(mask[n].flatten()).flatten() for n in names}
    else:
        mask = topk_mask({n: fisher[n].flatten()[inside[n]] for n in names}, k)
        support = {n: inside[n][torch.nonzero(mask[n]).flatten()] for n in names}
    del mask
    sampled = total > config.auc_cap
    sample: dict[str, torch.Tensor | None] = {}
    scores: dict[str, torch.Tensor] = {}
    for n in names:
        f = fisher[n].flatten().float()
        if sampled:
            idx = sample_index(n, size[n], round_half_up_ratio(config.auc_cap, size[n], total),
                                config.seed, f.device)
            idx = (inside[n][idx] if inside is not None else idx).sort().values
            sample[n], scores[n] = idx, f[idx].clone()
        elif inside is not None:
            sample[n], scores[n] = inside[n], f[inside[n]].clone()
        else:
            sample[n], scores[n] = None, f.clone()
        del f
    members: dict[str, dict[str, list[str]]] = {}
    rank_cols = {n: torch.empty((scores[n].numel(), len(GROUPINGS)), dtype=torch.int32) for n in names}
    for j, grouping in enumerate(GROUPINGS):
        groups: dict[str, list[str]] = {}
        for n in names:
            groups.setdefault(group_key(n, grouping), []).append(n)
        members[grouping] = groups
        for ms in groups.values():
            r, at = midranks(torch.cat([scores[n] for n in ms])), 0
            for n in ms:
                m = scores[n].numel()
                rank_cols[n][:, j] = (r[at:at + m] * 2).to(torch.int32)  # half-integers: exact
                at += m
            del r
    auc_n = sum(int(v.numel()) for v in scores.values())
    return _FisherPlan(names, k, total, support, sample, rank_cols, members, sampled, auc_n)


_ST_DTYPES = {"BF16": (torch.bfloat16, np.uint16), "F16": (torch.float16, np.float16),
              "F32": (torch.float32, np.float32), "F64": (torch.float64, np.float64)}


class _Slot:
    """A reusable byte buffer that holds one tensor at a time (grown to the largest)."""

    def __init__(self) -> None:
        self.buf = np.empty(0, np.uint8)

    def take(self, nbytes: int) -> np.ndarray:
        if self.buf.size < nbytes:
            self.buf = np.empty(nbytes, np.uint8)
        return self.buf[:nbytes]


class _Reader:
    """A source's tensors read into a caller's reusable buffer (a _Slot): a safetensors file's
    header parsed once, each tensor brought in with one pread (a copy from the page cache, no
    mapping kept, no file left open), so the series holds the base's, the previous and the
    current tensor of one name and nothing else. Sources that are not safetensors folders
    (state dicts, modules) use their `get`."""

    def __init__(self, source: Any) -> None:
        self.source = source
        self._where: dict[str, tuple[Path, str, int, int]] = {}  # name -> (file, dtype, start, end)
        where = getattr(source, "_where", None)
        if isinstance(where, dict):
            for f in sorted(set(where.values())):
                with open(f, "rb") as h:
                    size = int.from_bytes(h.read(8), "little")
                    header = json.loads(h.read(size))
                for n, meta in header.items():
                    if n != "__metadata__" and where.get(n) == f and meta.get("dtype") in _ST_DTYPES:
                        b, e = meta["data_offsets"]
                        self._where[n] = (f, meta["dtype"], 8 + size + b, 8 + size + e)

    def get(self, name: str, slot: _Slot) -> torch.Tensor:
        """The flat tensor `name`; for safetensors sources a view of `slot` (valid until the
        slot's next use)."""
        w = self._where.get(name)
        if w is None:
            return self.source.get(name).flatten()
        f, dt, start, end = w
        nbytes = end - start
        buf = slot.take(nbytes)
        view = buf.data
        fd = os.open(f, os.O_RDONLY)
        try:
            got = 0
            while got < nbytes:
                k = os.preadv(fd, [view[got:]], start + got)
                if k <= 0:
                    raise ValueError(f"{f}: tensor {name!r} is cut short (file truncated while reading?)")
                got += k
        finally:
            os.close(fd)
        tdt, ndt = _ST_DTYPES[dt]
        t = torch.from_numpy(buf.view(ndt))
        return t.view(torch.bfloat16) if tdt == torch.bfloat16 else t


# ---------------------------------------------------------------------------------------------
# Per tensor pair
# ---------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=64)
def bf16_round_threshold(atol: float) -> tuple[float, bool]:
    """(t, inclusive) such that for x >= 0 in float32: bf16(x) <= bf16(atol)  <=>  x <= t
    (inclusive) or x < t.

    This is the published convention's test as PyTorch evaluates it: `delta_bf16.abs() <= atol`
    on a bfloat16 tensor compares in bfloat16, atol rounded to bfloat16 too (1e-5 -> 1.00136e-5),
    and compute.sparsity.diff computes it so. bf16 rounds to nearest, ties to even: with a = bf16(atol),
    t is the midpoint between a and the next bfloat16, inclusive when a's last mantissa bit is even."""
    bits = int(torch.tensor([atol], dtype=torch.float32).to(torch.bfloat16).view(torch.int16)[0])
    mid = (_bf16(bits) + _bf16(bits + 1)) / 2  # exact in float32 (9 significant bits)
    return mid, bits % 2 == 0


def _bf16(bits: int) -> float:
    return float(torch.tensor([bits], dtype=torch.int16).view(torch.bfloat16)[0])


class _Work:
    """Reusable numpy buffers of one chunk, by (key, dtype)."""

    def __init__(self, size: int = 0) -> None:
        self.size = size
        self._bufs: dict[tuple[str, str], np.ndarray] = {}

    def get(self, key: str, dtype: Any, n: int) -> np.ndarray:
        k = (key, np.dtype(dtype).str)
        b = self._bufs.get(k)
        if b is None or b.size < n:
            b = np.empty(max(n, self.size), dtype=dtype)
            self._bufs[k] = b
        return b[:n]


@functools.lru_cache(maxsize=64)
def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    """A zero-copy numpy view of a flat CPU tensor; bfloat16 as its uint16 bit patterns."""
    t = t.detach().cpu()
    return t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()


def _f32(x: np.ndarray, work: _Work, key: str) -> np.ndarray:
    """float32 values of a chunk (exact for bf16/fp16, rounded to nearest for float64)."""
    if x.dtype == np.float32:
        return x
    if x.dtype == np.uint16:  # bfloat16 bits: the float32 with those 16 high bits
        u = work.get(key, np.uint32, x.size)
        np.copyto(u, x)
        np.left_shift(u, 16, out=u)
        return u.view(np.float32)
    out = work.get(key + "f", np.float32, x.size)
    np.copyto(out, x, casting="unsafe")
    return out


def _round_bf16(x: np.ndarray, work: _Work, key: str) -> np.ndarray:
    """float32 -> the nearest bfloat16 (ties to even), as float32: c10::BFloat16's rounding."""
    u = x.view(np.uint32)
    bias = work.get(key + "b", np.uint32, x.size)
    np.right_shift(u, 16, out=bias)
    np.bitwise_and(bias, 1, out=bias)
    np.add(bias, 0x7FFF, out=bias)
    out = work.get(key, np.uint32, x.size)
    np.add(u, bias, out=out)
    np.bitwise_and(out, 0xFFFF0000, out=out)
    return out.view(np.float32)


def tensor_counts(
    cur: torch.Tensor, refs: Sequence[torch.Tensor], atol: float, work: _Work | None = None,
    support: torch.Tensor | None = None, sample: torch.Tensor | None = None, want_labels: bool = False,
    chunk: int | None = None, kernel: bool | None = None,
) -> list[tuple[dict[str, float], torch.Tensor | None]]:
    """Counts of one tensor against each reference (flat tensors of one length), in one sweep.

    Per reference: ({numel, unchanged_exact, unchanged_bf16, unchanged_atol,
    unchanged_bf16delta_atol, sq_sum, max_abs, dense_bytes, sparse_bytes[, support_size,
    support_changed, support_sq, support_bytes]}, labels), labels = "changed" at the sample's
    coordinates (every coordinate when sample is None) when want_labels, else None.
    chunk: elements per sweep step (default CHUNK). kernel: None (default) uses
    compute.sparsity.series_kernel's fused C loop for bfloat16 / float32 pairs when it could be built,
    False always the numpy sweep, True requires the kernel (RuntimeError without it).

    The tensors are swept in chunks that stay in the CPU cache while every count of every
    reference is taken from them, with numpy's vectorised comparisons and counts (PyTorch's
    compare-to-bool and count_nonzero are scalar loops on CPU): each input is read from memory
    once, however many passes the counts need. Definitions are compute.sparsity.diff's, as PyTorch
    evaluates them (scalars compared in the tensor's dtype).
    """
    chunk = chunk or CHUNK
    work = work or _Work(min(chunk, cur.numel()))
    n = cur.numel()
    item = _itemsize(cur.dtype)
    t16, inclusive16 = bf16_round_threshold(atol)
    t16_32, atol32, zero = np.float32(t16), np.float32(atol), np.float32(0)
    le16 = np.less_equal if inclusive16 else np.less
    cn, rns = _as_numpy(cur.flatten()), [_as_numpy(r.flatten()) for r in refs]
    both16 = [cur.dtype == torch.bfloat16 and r.dtype == torch.bfloat16 for r in refs]
    f64 = [cur.dtype == torch.float64 or r.dtype == torch.float64 for r in refs]
    acc = [{"changed": 0, "unchanged_atol": 0, "unchanged_bf16": 0, "unchanged_bf16delta_atol": 0,
            "sq_sum": 0.0, "max_abs": 0.0} for _ in refs]
    lib = series_kernel.kernel() if kernel is not False else None
    if kernel and lib is None:
        raise RuntimeError("the series kernel is not available (no C compiler, or FISHERLENS_SERIES_KERNEL=0)")
    fused = [lib is not None and not f64[j] and series_kernel.supported(cn, rn) for j, rn in enumerate(rns)]
    for j, rn in enumerate(rns):
        if fused[j]:
            k, sq, mx = series_kernel.pair_counts(lib, cn, rn, atol32, t16_32, inclusive16)
            acc[j].update(changed=n - k[0], unchanged_atol=k[1], sq_sum=sq, max_abs=mx,
                          unchanged_bf16=k[3], unchanged_bf16delta_atol=k[2] if both16[j] else k[4])
    swept: list[np.ndarray | None] = [None if fused[j] else rn for j, rn in enumerate(rns)]
    for s0 in range(0, 0 if all(fused) else n, chunk):
        m = min(chunk, n - s0)
        c = cn[s0:s0 + m]
        c32 = _f32(c, work, "c32")
        c16: np.ndarray | None = None
        d, b = work.get("d", np.float32, m), work.get("b", np.bool_, m)
        for j, rj in enumerate(swept):
            if rj is None:
                continue
            a = acc[j]
            r = rj[s0:s0 + m]
            r32 = _f32(r, work, "r32")
            np.subtract(c32, r32, out=d)  # float32 arithmetic: exact zero iff equal (finite weights)
            np.abs(d, out=d)
            if f64[j]:  # exact in double, as compute.sparsity.diff
                a["changed"] += int(np.count_nonzero(np.not_equal(c.astype(np.float64), r.astype(np.float64))))
            else:
                a["changed"] += m - int(np.count_nonzero(np.less_equal(d, zero, out=b)))
            a["unchanged_atol"] += int(np.count_nonzero(np.less_equal(d, atol32, out=b)))
            a["sq_sum"] += float(np.dot(d, d))
            a["max_abs"] = max(a["max_abs"], float(d.max()))
            if both16[j]:
                # bf16(cur) - bf16(ref) computed in bfloat16 is the bf16 rounding of this float32
                # delta: its |.| <= bf16(atol) is a threshold on |delta_fp32| (bf16_round_threshold)
                a["unchanged_bf16delta_atol"] += int(np.count_nonzero(le16(d, t16_32, out=b)))
            else:
                if c16 is None:
                    c16 = c32 if c.dtype == np.uint16 else _round_bf16(c32, work, "c16")
                r16 = r32 if r.dtype == np.uint16 else _round_bf16(r32, work, "r16")
                dd = work.get("dd", np.float32, m)
                np.subtract(c16, r16, out=dd)  # PyTorch's bf16 subtraction before its rounding
                np.abs(dd, out=dd)
                a["unchanged_bf16"] += int(np.count_nonzero(np.less_equal(dd, zero, out=b)))
                a["unchanged_bf16delta_atol"] += int(np.count_nonzero(le16(dd, t16_32, out=b)))
    out: list[tuple[dict[str, float], torch.Tensor | None]] = []
    cf = cur.flatten()
    c_support = cf.index_select(0, support).float() if support is not None else None
    c_sample = (cf.index_select(0, sample) if sample is not None else cf) if want_labels else None
    for j, (a, ref) in enumerate(zip(acc, refs, strict=True)):
        changed = int(a.pop("changed"))
        st: dict[str, float] = {"numel": float(n), **{k: float(v) for k, v in a.items()}}
        st["unchanged_exact"] = float(n - changed)
        if both16[j]:
            st["unchanged_bf16"] = float(n - changed)  # bf16 equality is equality
        st["unchanged_common"] = _unchanged_common(cur, ref, st)
        st["sq_common"] = st["sq_sum"]  # the delta in the compared precision (recast in _PointAcc.add)
        low = precision.lower_precision(cur.dtype, ref.dtype)
        st["dense_bytes"] = float(n * item)
        # indices + values of the coordinates changed in the compared precision, values in it
        st["sparse_bytes"] = precision.sparse_sync_bytes(n - st["unchanged_common"], n, low)
        st["sync_bytes"] = min(st["sparse_bytes"], st["dense_bytes"])  # the cheaper, per tensor
        rf = ref.flatten()
        if c_support is not None and support is not None:
            g = c_support - rf.index_select(0, support).float()  # the float32 delta on S
            st["support_size"] = float(support.numel())
            st["support_changed"] = float(torch.count_nonzero(g))
            st["support_sq"] = float(torch.sum(g.double().square()))
            st["support_bytes"] = float(support.numel() * item)
        labels = None
        if c_sample is not None:
            labels = _not_equal(c_sample, rf.index_select(0, sample) if sample is not None else rf)
        out.append((st, labels))
    return out


def _unchanged_common(cur: torch.Tensor, ref: torch.Tensor, st: Mapping[str, float]) -> float:
    """Coordinates equal in the lower of the two stored precisions (compute.contract.precision):
    exact equality for one dtype, the bf16 count for bfloat16 against a wider dtype, else both
    cast (float16, float8: rare, through PyTorch)."""
    if cur.dtype == ref.dtype:
        return st["unchanged_exact"]
    low = precision.lower_precision(cur.dtype, ref.dtype)
    if low == "bfloat16":
        return st["unchanged_bf16"]
    tl = getattr(torch, low)
    return float((cur.flatten().to(tl) == ref.flatten().to(tl)).sum())


def _cast_pair(cur: torch.Tensor, ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both sides in the lower of their precisions (each unchanged when already there)."""
    low = getattr(torch, precision.lower_precision(cur.dtype, ref.dtype))
    return (cur if cur.dtype == low else cur.to(low)), (ref if ref.dtype == low else ref.to(low))


def _not_equal(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`a != b` as PyTorch evaluates it (both promoted to a common dtype), with numpy's vectorised
    compare: bfloat16 / float16 / float32 values are exact in float32, so comparing there is the
    same (NaN unequal, -0 == +0); float64 goes through PyTorch."""
    if torch.float64 in (a.dtype, b.dtype):
        return a != b
    an, bn = _as_numpy(a.float()), _as_numpy(b.float())
    return torch.from_numpy(np.not_equal(an, bn))


# ---------------------------------------------------------------------------------------------
# Groups and fractions
# ---------------------------------------------------------------------------------------------


_SUMMED = ("numel", "unchanged_exact", "unchanged_common", "unchanged_bf16", "unchanged_atol",
           "unchanged_bf16delta_atol", "sq_sum", "sq_common", "dense_bytes", "sparse_bytes", "sync_bytes",
           "support_size", "support_changed", "support_sq", "support_bytes")


def _metrics(c: Mapping[str, float], atol: float) -> dict[str, float]:
    """Fractions and shares from summed counts. Key names follow compute.sparsity.diff."""
    n = c["numel"]
    nan = float("nan")
    common = c.get("unchanged_common", c["unchanged_exact"])
    changed = n - common  # in the compared precision (compute.contract.precision)
    sq = c.get("sq_common", c["sq_sum"])
    out = {
        "numel": n,
        "changed": changed,
        "changed_exact": n - c["unchanged_exact"],
        "update_sparsity": common / n if n else nan,
        "unchanged_common": common / n if n else nan,
        "unchanged_exact": c["unchanged_exact"] / n if n else nan,
        "unchanged_bf16": c["unchanged_bf16"] / n if n else nan,
        f"unchanged_atol_{atol:g}": c["unchanged_atol"] / n if n else nan,
        f"unchanged_bf16delta_atol_{atol:g}": c["unchanged_bf16delta_atol"] / n if n else nan,
        "delta_rms": math.sqrt(c["sq_sum"] / n) if n else nan,
        "max_abs_delta": c["max_abs"],
        "dense_bytes": c["dense_bytes"],
        "sparse_bytes": c["sparse_bytes"],
        "sparse_ratio": c["sparse_bytes"] / c["dense_bytes"] if c["dense_bytes"] else nan,
        "sync_bytes": c.get("sync_bytes", min(c["sparse_bytes"], c["dense_bytes"])),
    }
    if "support_size" in c:
        size, hit = c["support_size"], c["support_changed"]
        out.update({
            "support_size": size,
            "support_changed": hit,
            "support_bytes": c["support_bytes"],
            "support_ratio": c["support_bytes"] / c["dense_bytes"] if c["dense_bytes"] else nan,
            "precision_at_k": hit / size if size else nan,
            "captured_count_share": hit / changed if changed else nan,
            "captured_sq_share": c["support_sq"] / sq if sq > 0 else nan,
        })
    return out


@functools.lru_cache(maxsize=65536)
def _group_key(name: str, grouping: str) -> str:
    return group_key(name, grouping)


def _group(per_tensor: Mapping[str, Mapping[str, float]], atol: float) -> dict[str, dict[str, dict[str, float]]]:
    """Per-tensor counts summed per group (in name order, left to right), max_abs the maximum."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    if not per_tensor:
        return {grouping: {} for grouping in GROUPINGS}
    keys = [k for k in next(iter(per_tensor.values())) if k in _SUMMED]  # every tensor has the same keys
    for grouping in GROUPINGS:
        members: dict[str, list[Mapping[str, float]]] = {}
        for n, st in per_tensor.items():
            members.setdefault(_group_key(n, grouping), []).append(st)
        groups = {}
        for g, sts in members.items():
            a = {k: sum((st[k] for st in sts), 0.0) for k in keys}
            m = 0.0
            for st in sts:
                m = max(m, st["max_abs"])
            a["max_abs"] = m
            groups[g] = _metrics(a, atol)
        out[grouping] = groups
    return out


def _auc_from_sums(rank_sum: float, n_pos: int, n: int) -> float:
    """Mann-Whitney AUC (compute.sparsity.overlap.roc_auc: ties one half) from the sum of the score's
    mid-ranks over the positives, their number and the sample's size."""
    n_neg = n - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    return (rank_sum - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


# ---------------------------------------------------------------------------------------------
# The series
# ---------------------------------------------------------------------------------------------


@dataclass
class SeriesResult:
    points: list[dict[str, Any]]  # one per checkpoint, by step
    settings: dict[str, Any]
    skipped: dict[str, str] = field(default_factory=dict)  # name -> why (non-float tensors)

    def to_json(self) -> dict[str, Any]:
        return {"points": self.points, "settings": self.settings, "skipped": self.skipped,
                "steps": [p["step"] for p in self.points]}


def checkpoint_series(
    base: Any,
    run: str | Path | Sequence[RunCheckpoint],
    fisher: Mapping[str, torch.Tensor] | None = None,
    config: SeriesConfig | None = None,
    progress: Callable[..., None] | None = None,
    within: Mapping[str, torch.Tensor] | None = None,
) -> SeriesResult:
    """The series of a run folder (or its opened checkpoints) against `base` (a compute.sparsity.diff
    Checkpoint, a folder, a state dict or a module). ValueError before any computation for a run
    folder without checkpoints, an odd checkpoint-* entry, or a checkpoint or Fisher that does not
    fit the base. within: the mask the run trained inside (plan_fisher)."""
    from compute.sparsity.diff import Checkpoint, as_source

    config = config or SeriesConfig()
    progress = progress or null_progress
    # a folder here is already resolved (the job's reference resolver checked it)
    src_b = Checkpoint(base, "base") if isinstance(base, (str, Path)) else as_source(base, "base")
    ckpts = open_run(run) if isinstance(run, (str, Path)) else list(run)
    if not ckpts:
        raise ValueError("run_dir: no checkpoint to read")
    names = check_run_fits(src_b, ckpts)
    plan = plan_fisher(fisher, src_b, config, within) if fisher is not None else None
    skipped = {n: f"not a float tensor ({src_b.dtype(n)})" for n in names
               if not _is_float(src_b.dtype(n)) or any(not _is_float(c.source.dtype(n)) for c in ckpts)}
    names = [n for n in names if n not in skipped]
    work = _Work(CHUNK)
    t_start = time.perf_counter()
    # name by name, every checkpoint in step order: each tensor is read once (the base's, then
    # checkpoint k's, which is the previous one of checkpoint k+1), into three reusable slots
    readers = [_Reader(src_b)] + [_Reader(ck.source) for ck in ckpts]
    slots = (_Slot(), _Slot(), _Slot())
    accs = [_PointAcc() for _ in ckpts]
    # the loop makes no cyclic garbage, but a full collection of the whole process (~0.1 s in a
    # worker) could land in one point's timed work: pause the collector meanwhile, as timeit does
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for j, n in enumerate(names):
            progress(j / len(names), f"{n} ({j + 1}/{len(names)} tensors x {len(ckpts)} checkpoints)")
            t0 = time.perf_counter()
            base_t = readers[0].get(n, slots[0])
            base_s = (time.perf_counter() - t0) / len(ckpts)  # the base's read, shared by every point
            prev_t = base_t
            for i, acc in enumerate(accs):
                t0 = time.perf_counter()
                cur_t = readers[i + 1].get(n, slots[1 + i % 2])
                acc.add(n, cur_t, base_t, prev_t, plan, config, work)
                acc.seconds += time.perf_counter() - t0 + base_s
                prev_t = cur_t
            del base_t, prev_t
    finally:
        if gc_was_enabled:
            gc.enable()
    points = []
    for i, (ck, acc) in enumerate(zip(ckpts, accs, strict=True)):
        t0 = time.perf_counter()
        point = acc.finish(ck, plan, config)
        point["prev_step"] = ckpts[i - 1].step if i else 0
        point["seconds"] = round(acc.seconds + time.perf_counter() - t0, 4)
        points.append(point)
    progress(1.0, f"{len(ckpts)} checkpoints in {time.perf_counter() - t_start:.1f} s")
    return SeriesResult(points, _settings(config, plan), skipped)


def _is_float(dtype: str) -> bool:
    return dtype.upper().replace("TORCH.", "").startswith(("F", "BF"))


class _PointAcc:
    """One checkpoint's per-tensor counts as the names stream by, and its seconds."""

    def __init__(self) -> None:
        self.per: dict[str, dict[str, dict[str, float]]] = {p: {} for p in PAIRS}
        # per pair and tensor: (rank sum over the changed sample coordinates per grouping, changed,
        # m); mid-ranks are half-integers, so these float64 sums are exact (below 2^52) and add up
        # exactly
        self.ranked: dict[str, dict[str, tuple[list[float], int, int]]] = {p: {} for p in PAIRS}
        self.dtypes: dict[str, int] = {}
        self.stored: dict[str, tuple[set[str], set[str]]] = {p: (set(), set()) for p in PAIRS}  # ref, cur
        self.seconds = 0.0

    def add(self, n: str, cur: torch.Tensor, base: torch.Tensor, prev: torch.Tensor, plan: _FisherPlan | None,
            config: SeriesConfig, work: _Work) -> None:
        dt = str(cur.dtype).replace("torch.", "")
        self.dtypes[dt] = self.dtypes.get(dt, 0) + cur.numel()
        for pair, ref in zip(PAIRS, (base, prev), strict=True):
            self.stored[pair][0].add(precision.dtype_name(ref.dtype))
            self.stored[pair][1].add(dt)
        in_fisher = plan is not None and n in plan.support
        if plan is not None and in_fisher and (base.dtype != cur.dtype or prev.dtype != cur.dtype):
            self._add_mixed(n, cur, base, prev, plan, config, work)
            return
        lib = series_kernel.kernel() if in_fisher else None
        arrays = [_as_numpy(t) for t in (cur, base, prev)] if lib is not None else []
        if plan is not None and lib is not None and all(a.dtype in (np.uint16, np.float32) for a in arrays):
            # the dense counts, then the Fisher's share in one C loop (gathers, labels, rank sums)
            res = tensor_counts(cur, [base, prev], config.atol, work)
            self._fisher_kernel(n, lib, arrays, plan, cur, [c for c, _ in res])
            return
        res = tensor_counts(cur, [base, prev], config.atol, work,
                            support=plan.support[n] if plan is not None and in_fisher else None,
                            sample=plan.sample[n] if plan is not None and in_fisher else None,
                            want_labels=in_fisher)
        for pair, (counts, lab) in zip(PAIRS, res, strict=True):
            if plan is not None and not in_fisher:  # outside the Fisher: not in the support
                counts.update(support_size=0.0, support_changed=0.0, support_sq=0.0, support_bytes=0.0)
            self.per[pair][n] = counts
            if lab is not None and plan is not None:
                self._rank(pair, n, plan, lab)

    def _rank(self, pair: str, n: str, plan: _FisherPlan, lab: torch.Tensor) -> None:
        sums = torch.mv(plan.rank_cols[n].t().double(), lab.to(torch.float64)).tolist()
        self.ranked[pair][n] = ([x / 2 for x in sums], int(np.count_nonzero(_as_numpy(lab))), lab.numel())

    def _fisher_kernel(self, n: str, lib: Any, arrays: list[np.ndarray], plan: _FisherPlan, cur: torch.Tensor,
                       counts: list[dict[str, float]]) -> None:
        sample = plan.sample[n]
        m = cur.numel() if sample is None else sample.numel()
        fp = series_kernel.fisher_pair(lib, arrays[0], arrays[1:], None if sample is None else sample.numpy(),
                                       m, plan.rank_cols[n].numpy(), plan.support[n].numpy())
        item = _itemsize(cur.dtype)
        for pair, c, (sums2, npos, sup_changed, sup_sq) in zip(PAIRS, counts, fp, strict=True):
            c.update(support_size=float(plan.support[n].numel()), support_changed=float(sup_changed),
                     support_sq=sup_sq, support_bytes=float(plan.support[n].numel() * item))
            self.per[pair][n] = c
            self.ranked[pair][n] = ([x / 2 for x in sums2], npos, m)

    def _add_mixed(self, n: str, cur: torch.Tensor, base: torch.Tensor, prev: torch.Tensor, plan: _FisherPlan,
                   config: SeriesConfig, work: _Work) -> None:
        """A tensor whose checkpoint and reference are stored at different precisions: the dense
        counts as stored (every convention), the Fisher's share (changed labels, support, the
        squared update it carries) with both sides cast to the lower precision
        (compute.contract.precision): exact equality across precisions labels every rounded
        weight "changed"."""
        res = tensor_counts(cur, [base, prev], config.atol, work)
        for pair, ref, (counts, _) in zip(PAIRS, (base, prev), res, strict=True):
            c, r = _cast_pair(cur, ref)
            (fc, lab), = tensor_counts(c, [r], config.atol, None, support=plan.support[n], sample=plan.sample[n],
                                       want_labels=True)
            counts.update({k: fc[k] for k in ("support_size", "support_changed", "support_sq")})
            counts["support_bytes"] = float(plan.support[n].numel() * _itemsize(c.dtype))
            counts["sq_common"] = fc["sq_sum"]
            self.per[pair][n] = counts
            assert lab is not None
            self._rank(pair, n, plan, lab)

    def finish(self, ck: RunCheckpoint, plan: _FisherPlan | None, config: SeriesConfig) -> dict[str, Any]:
        dtypes = self.dtypes
        point: dict[str, Any] = {"step": ck.step, "checkpoint": ck.name,
                                 "dtype": max(dtypes, key=lambda k: dtypes[k]) if dtypes else None}
        for pair in PAIRS:
            groups = _group(self.per[pair], config.atol)
            if plan is not None:
                ranked = self.ranked[pair]
                for j, (grouping, gs) in enumerate(plan.members.items()):
                    for g, ms in gs.items():
                        rs = [ranked[m] for m in ms]
                        auc = _auc_from_sums(sum(r[0][j] for r in rs), sum(r[1] for r in rs),
                                             sum(r[2] for r in rs))
                        groups[grouping].setdefault(g, {})["auc"] = auc
            point[pair] = groups
            point[f"{pair}_precision"] = precision.comparison(*self.stored[pair], sides=(
                "base" if pair == "vs_base" else "previous", "checkpoint"))
        if ck.trainer:
            point["trainer"] = ck.trainer
        return point


def _settings(config: SeriesConfig, plan: _FisherPlan | None) -> dict[str, Any]:
    a = f"{config.atol:g}"
    out: dict[str, Any] = {
        **asdict(config),
        "pairs": {"vs_base": "each checkpoint against the base (cumulative update)",
                  "vs_prev": "each checkpoint against the previous one, the base for the first (one step)"},
        "conventions": {
            "unchanged_exact": "equal in the stored dtype; update_sparsity is this fraction",
            "unchanged_bf16": "equal after casting both to bfloat16",
            f"unchanged_atol_{a}": f"|cur_fp32 - ref_fp32| <= {a} (float32 delta)",
            f"unchanged_bf16delta_atol_{a}": f"both loaded in bfloat16, |cur_bf16 - ref_bf16| <= {a} in "
                                             "bfloat16 (published convention, sparsity_in_rl)",
        },
        "sync": {
            "dense_bytes": "numel x itemsize of the checkpoint's dtype",
            "sparse_bytes": "changed coordinates x (index + value): int32 flat index per tensor (int64 from "
                            "2^31 elements), value in the checkpoint's dtype",
            "support_bytes": "values only on the Fisher's fixed top-k support (indices sent once)",
            "captured_count_share": "|support & changed| / |changed|",
            "captured_sq_share": "sum over the support of delta^2 / sum delta^2 (float32 delta)",
            "precision_at_k": "|support & changed| / |support|",
        },
        "groupings": list(GROUPINGS),
    }
    if plan is not None:
        out["fisher"] = {"k": plan.k, "n": plan.total, "tensors": len(plan.names),
                         "support": f"global top-{config.support_percent:g}% (compute.sparsity.masks.topk_mask)",
                         "auc_sampled": plan.sampled, "auc_cap": config.auc_cap,
                         "auc_n": plan.auc_n,
                         "auc": "ROC-AUC of the Fisher for 'changed' (exact), ties one half"}
    return out


def write_series(result: SeriesResult, out_dir: str | Path) -> Path:
    """DIR/series.json (NaN written as null)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "series.json"
    path.write_text(json.dumps(_json_safe(result.to_json()), indent=1, sort_keys=False))
    return path


def _json_safe(x: Any) -> Any:
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x
