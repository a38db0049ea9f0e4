"""Update sparsity: which coordinates did post-training change, and does the Fisher predict them?

For two checkpoints of the same architecture, per tensor and aggregated per layer, module type,
layer x module and globally:
- the headline, `unchanged_common`: exact equality when both checkpoints are stored in one dtype,
  else equality after casting both to the lower of the two stored precisions (a bf16-mixed run
  saves bf16 weights; against an fp32 base, exact equality would count every weight that bf16
  storage rounded as changed). CheckpointDiff.precision records both stored dtypes and the convention;
- fraction unchanged by exact equality (in the stored dtype), by bf16 equality (both cast to
  bfloat16), by |delta| <= atol for each atol in ATOLS, and by |delta| <= r * rms(base tensor)
  for each r in REL_TOLS; delta = tuned - base computed in float32;
- the same atol columns in the PUBLISHED convention (sparsity_in_rl, arXiv 2505.11711): both
  checkpoints loaded in bfloat16 and delta_bf16 = tuned_bf16 - base_bf16 computed in bfloat16
  (`unchanged_bf16delta_atol_<a>`). The two conventions give different numbers on the same pair
  (docs/science.md section 6): a reader comparing with published sparsity wants the bf16 columns;
- |w|-aware precision counts: `unchanged_below_half_ulp` = coordinates whose float32 |delta| is
  below half a bf16 ULP of |w_base| (an update that bf16 storage would round away, up to where w
  sits in its rounding interval), and `changed_below_half_ulp` = those among them with delta != 0.
  Half a bf16 ULP of w with |w| = m 2^e (m in [0.5, 1)) is 2^(e - 9), i.e. between |w| 2^-9 and
  |w| 2^-8; for w == 0 it is half the smallest bf16 subnormal, 2^-134;
- delta RMS and max |delta|, and the share of the delta's energy (sum delta^2) in the top
  {0.1, 1, 5}% coordinates of the tensor;
- for 2-D tensors: numerical rank of the delta (singular values > RANK_RTOL_DOC) and the energy
  share of the top-k singular values (k in SVD_TOPK); skipped above `svd_max_numel` elements.
With a Fisher dict: precision@k / AUC / Jaccard (vs random) / Spearman between the top-k% Fisher
coordinates and the top-k% |delta| (compute.sparsity.overlap), and AUC of the Fisher for "changed at all".

Checkpoints are read tensor by tensor straight from safetensors (single file or sharded index),
so at most one tensor of each model is in memory unless |delta| is kept for the Fisher comparison.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from compute.contract.cost import SVD_MAX_NUMEL as COST_SVD_MAX_NUMEL
from compute.contract.jobresult import Progress
from compute.sparsity.masks import group_key

ATOLS = (1e-8, 1e-7, 1e-6, 1e-5, 1e-4)
REL_TOLS = (1e-4, 1e-3, 1e-2)
ENERGY_TOP_PERCENT = (0.1, 1.0, 5.0)
SVD_TOPK = (1, 4, 16)
RANK_RTOL_DOC = "max(m, n) * eps(float32) * s_max (numpy.linalg.matrix_rank's default)"
SVD_MAX_NUMEL = COST_SVD_MAX_NUMEL  # one number for the job and its estimate
GROUPINGS = ("global", "layer", "module", "layer_module")



# ---------------------------------------------------------------------------------------------
# Reading checkpoints
# ---------------------------------------------------------------------------------------------


class Checkpoint:
    """Tensors of a HF checkpoint folder, read lazily from its safetensors file(s)."""

    def __init__(self, folder: str | Path, label: str = "model"):
        self.folder = Path(folder)
        self.label = label
        self._where: dict[str, Path] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._dtypes: dict[str, str] = {}
        files = self._weight_files()
        from safetensors import safe_open

        for f in files:
            with safe_open(str(f), framework="pt") as h:
                for name in h.keys():  # noqa: SIM118 - safe_open handles are not dicts
                    sl = h.get_slice(name)
                    self._where[name] = f
                    self._shapes[name] = tuple(sl.get_shape())
                    self._dtypes[name] = str(sl.get_dtype())

    def _weight_files(self) -> list[Path]:
        if not self.folder.is_dir():
            raise ValueError(f"{self.label}: {self.folder} is not a directory")
        index = self.folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map", {})
            files = sorted({self.folder / v for v in weight_map.values()})
            missing = [f for f in files if not f.is_file()]
            if missing:
                raise ValueError(f"{self.label}: shard {missing[0].name} listed in {index} is missing")
            return files
        single = self.folder / "model.safetensors"
        if single.is_file():
            return [single]
        # fisherlens artifacts that may sit next to the weights (e.g. a training output's mask)
        files = sorted(f for f in self.folder.glob("*.safetensors")
                       if f.stem not in ("mask", "fisher", "delta", "gradient"))
        if not files:
            raise ValueError(f"{self.label}: no safetensors weights in {self.folder} "
                             "(save the model with safe_serialization=True)")
        return files

    def names(self) -> list[str]:
        return sorted(self._shapes)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def dtype(self, name: str) -> str:
        return self._dtypes[name]

    def get(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(self._where[name]), framework="pt") as h:
            return h.get_tensor(name)

    def get_flat(self, name: str, i: int, j: int) -> torch.Tensor:
        """Values [i, j) of the flattened tensor, read as the whole rows that hold them (never
        the tensor: a row slice of the file)."""
        from safetensors import safe_open

        shape = self._shapes[name]
        with safe_open(str(self._where[name]), framework="pt") as h:
            if len(shape) == 0:
                return h.get_tensor(name).reshape(-1)[i:j]
            row = math.prod(shape[1:])
            r0, r1 = i // max(row, 1), -(-j // max(row, 1))
            rows = h.get_slice(name)[r0:r1]
        return rows.reshape(-1)[i - r0 * row: j - r0 * row]


class LazyTensor:
    """A tensor of a checkpoint read a flat slice at a time (`flat(i, j)`), for tensor_diff_stats:
    the diff of a run against its base file holds a slice of the base, not the tensor (issue 30).
    `convert` maps the stored values to the compared ones (elementwise casts only)."""

    def __init__(self, ckpt: Any, name: str, dtype: torch.dtype, convert: Any = None):
        self.ckpt, self.name, self.dtype = ckpt, name, dtype
        self.shape = torch.Size(ckpt.shape(name))
        self.convert = convert or (lambda t: t)

    def numel(self) -> int:
        return self.shape.numel()

    def dim(self) -> int:
        return len(self.shape)

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point

    def flat(self, i: int, j: int) -> torch.Tensor:
        return self.convert(self.ckpt.get_flat(self.name, i, j))

    def full(self) -> torch.Tensor:
        return self.convert(self.ckpt.get(self.name))


def _flat(t: Any, i: int, j: int) -> torch.Tensor:
    return t.flat(i, j) if isinstance(t, LazyTensor) else t.reshape(-1)[i:j]


def open_checkpoint(ref: Any, label: str = "model", settings: Any | None = None) -> Checkpoint:
    """A resolved Ref (what runners get) -> Checkpoint, read where it is; for library callers a
    zoo name, an allowed local HF directory or a hub id (compute.contract.modelref)."""
    from compute.contract.kinds import Ref
    from compute.contract.modelref import is_hub_id, resolve_model

    if isinstance(ref, Ref):
        resolved = ref.where()
    else:
        try:
            resolved = resolve_model(str(ref), settings)
        except ValueError as exc:
            raise ValueError(str(exc).replace("model:", f"{label}:", 1)) from None
    if is_hub_id(resolved):
        resolved = _hub_cache_dir(resolved, label)
    return Checkpoint(resolved, label)


def _hub_cache_dir(repo_id: str, label: str) -> str:
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(repo_id, local_files_only=True, allow_patterns=["*.json", "*.safetensors"])
    except Exception as exc:  # noqa: BLE001 - any hub error means "not available locally"
        raise ValueError(f"{label}: hub model {repo_id!r} is not in the local cache ({type(exc).__name__}); "
                         "download it first or give a local directory") from None


class _DictSource:
    """A plain state dict with the Checkpoint interface (for tests and in-memory models)."""

    def __init__(self, sd: Mapping[str, torch.Tensor], label: str):
        self.sd, self.label = sd, label

    def names(self) -> list[str]:
        return sorted(self.sd)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.sd[name].shape)

    def dtype(self, name: str) -> str:
        return str(self.sd[name].dtype).replace("torch.", "")

    def get(self, name: str) -> torch.Tensor:
        return self.sd[name]


def as_source(x: Any, label: str) -> Any:
    """A Checkpoint-like source (names, shape, dtype, get: read one tensor at a time) of x."""
    if isinstance(x, (Checkpoint, _DictSource)):
        return x
    if not isinstance(x, Mapping) and all(hasattr(x, a) for a in ("names", "shape", "dtype", "get")):
        return x  # another lazy source (e.g. compute.jobs.train_run's base read from its file)
    if isinstance(x, Mapping):
        return _DictSource(x, label)
    if isinstance(x, torch.nn.Module):
        return _DictSource(x.state_dict(), label)
    return open_checkpoint(x, label)


def check_same_architecture(base: Any, tuned: Any) -> None:
    """ValueError naming the first parameter (sorted) missing on one side or differing in shape."""
    from compute.contract.shapes import mismatch

    why = mismatch({n: base.shape(n) for n in base.names()}, {n: tuned.shape(n) for n in tuned.names()},
                   "base", "tuned", both=True)
    if why:
        raise ValueError(f"tuned: different architecture: {why}")


# ---------------------------------------------------------------------------------------------
# Per-tensor statistics (pure)
# ---------------------------------------------------------------------------------------------


def threshold_labels() -> list[str]:
    """Column names of the unchanged-fraction counts, in order: common (equal at the lower of the
    two stored precisions: the headline), exact, bf16, float32-delta atols, bf16-delta atols
    (published convention), relative tolerances, below half a bf16 ULP."""
    return ["common", "exact", "bf16", *[f"atol_{a:g}" for a in ATOLS],
            *[f"bf16delta_atol_{a:g}" for a in ATOLS], *[f"rel_{r:g}" for r in REL_TOLS],
            "below_half_ulp"]


def lower_precision(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """The float dtype with fewer mantissa bits (compute.contract.precision.lower_precision): the
    precision two checkpoints stored in `a` and `b` can both be compared in."""
    from compute.contract.precision import lower_precision as lower

    return a if a == b else getattr(torch, lower(a, b))


def comparison_convention(base_dtypes: set[str], tuned_dtypes: set[str]) -> dict[str, Any]:
    """How a diff of checkpoints stored in these (float) dtypes counts "unchanged": the one
    headline policy of every kind (compute.contract.precision.comparison).

    -> {"stored_dtypes": {"base", "tuned"}, "comparison_dtype", "rule", "comparison": text}."""
    from compute.contract.precision import comparison

    return comparison(base_dtypes, tuned_dtypes)


def half_ulp_bf16(w: torch.Tensor) -> torch.Tensor:
    """Half a bfloat16 ULP at |w|, float32, same shape: 2^(e - 9) for |w| = m 2^e, m in [0.5, 1);
    2^-134 (half the smallest bf16 subnormal) where w == 0."""
    w = w.to(torch.float32)
    _, e = torch.frexp(w)
    half = torch.ldexp(torch.ones_like(w), (e - 9).to(torch.int32))
    return torch.where(w == 0, torch.full_like(w, 2.0**-134), half)


# values per chunk of tensor_diff_stats' temporaries (1 MiB as float32): about ten of them are alive
# at once, 40 MiB at 1M values, which was the peak of a masked 20M model's job (issue 30: 4.6
# bytes/param there, benchmarks/bench_scale_train.py --stacks)
DIFF_CHUNK = 1 << 18


def _abs_delta(b32: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """|tuned - base| in float32 of one chunk (base already float32): one function for
    tensor_diff_stats' pass and _SquaredDeltas' second one, which must make the same bits."""
    return (t.to(torch.float32) - b32).abs()


class _SquaredDeltas:
    """The squared deltas (tuned - base)^2 of one tensor (float32), made again a chunk at a time
    in the order tensor_diff_stats makes them (the chunks() protocol of the streaming statistics:
    the second pass of ValueHistogram.top_sums)."""

    def __init__(self, base: Any, flat_tuned: torch.Tensor, n: int, chunk: int):
        self.base, self.ft, self.n, self.chunk = base, flat_tuned, n, chunk

    def numel(self) -> int:
        return self.n

    def chunks(self, size: int) -> Iterator[torch.Tensor]:
        for i in range(0, self.n, self.chunk):
            j = min(self.n, i + self.chunk)
            yield _abs_delta(_flat(self.base, i, j).to(torch.float32), self.ft[i:j]).square()


def tensor_diff_stats(base: torch.Tensor, tuned: torch.Tensor, svd_max_numel: int = SVD_MAX_NUMEL,
                      need_delta: bool = True, chunk: int = DIFF_CHUNK, clock: dict[str, float] | None = None,
                      ) -> tuple[dict[str, float], torch.Tensor | None]:
    """Counts and statistics of delta = tuned - base for one tensor; returns (stats, delta fp32,
    or None when not `need_delta` and no SVD is taken).

    stats: numel, unchanged_<label> counts (see threshold_labels), sq_sum (sum delta^2),
    max_abs, base_rms, energy_top_<p>pct, and for 2-D tensors rank, svd_top<k>_energy.
    Computed over flat chunks of `chunk` values, so the temporaries are a few chunks whatever the
    tensor's size (issue 30: an embedding is a large share of a model); the counts are exact, the
    sums float64.
    """
    if base.shape != tuned.shape:
        raise ValueError(f"tuned: shapes differ: {list(base.shape)} vs {list(tuned.shape)}")
    n = base.numel()
    s: dict[str, float] = {"numel": float(n)}
    ft = tuned.reshape(-1)
    spans = [(i, min(n, i + chunk)) for i in range(0, n, chunk)]
    base_sq = sum(float(torch.sum(_flat(base, i, j).to(torch.float32).square(), dtype=torch.float64))
                  for i, j in spans)
    rms = math.sqrt(base_sq / n) if n else 0.0
    keys = ["unchanged_exact", "unchanged_common", "zero_in_base", "changed_from_zero", "unchanged_bf16",
            *(f"unchanged_bf16delta_atol_{a:g}" for a in ATOLS), *(f"unchanged_atol_{a:g}" for a in ATOLS),
            "unchanged_below_half_ulp", "changed_below_half_ulp", *(f"unchanged_rel_{r:g}" for r in REL_TOLS)]
    cnt = dict.fromkeys(keys, 0)
    sq_sum, max_abs = 0.0, 0.0
    # the energy shares: a streaming histogram of the squared deltas, its cut bins resolved by a
    # second pass that makes the squares again (issue 30: the running top 5% of a tensor's squares,
    # merged chunk by chunk with topk and its int64 indices, was the masked 20M job's peak)
    from compute.fisher.statistics import ValueHistogram

    hist = ValueHistogram.empty(_SquaredDeltas(base, ft, n, chunk))
    for i, j in spans:
        b, t = _flat(base, i, j), ft[i:j]
        if b.dtype == t.dtype:
            same = b == t
            cnt["unchanged_exact"] += int(same.sum())
            cnt["unchanged_common"] += int(same.sum())
        else:
            cnt["unchanged_exact"] += int((b.double() == t.double()).sum())
            low = lower_precision(b.dtype, t.dtype)
            same = b.to(low) == t.to(low)
            cnt["unchanged_common"] += int(same.sum())
        # weights exactly 0 in the base have no rounding slack: any nonzero update, however small,
        # shows in any stored precision (the SGD finding of docs/reading-results.md)
        zero = b == 0
        cnt["zero_in_base"] += int(zero.sum())
        cnt["changed_from_zero"] += int((zero & ~same).sum())
        del same, zero
        bb, tb = b.to(torch.bfloat16), t.to(torch.bfloat16)
        cnt["unchanged_bf16"] += int((bb == tb).sum())
        ad16 = (tb - bb).abs()  # bf16 arithmetic, as after loading both checkpoints in bf16
        for a in ATOLS:
            cnt[f"unchanged_bf16delta_atol_{a:g}"] += int((ad16 <= a).sum())
        del bb, tb, ad16
        b32 = b.to(torch.float32)
        ad = _abs_delta(b32, t)
        for a in ATOLS:
            cnt[f"unchanged_atol_{a:g}"] += int((ad <= a).sum())
        below = ad < half_ulp_bf16(b32)
        cnt["unchanged_below_half_ulp"] += int(below.sum())
        cnt["changed_below_half_ulp"] += int((below & (ad > 0)).sum())
        del below, b32
        for r in REL_TOLS:
            cnt[f"unchanged_rel_{r:g}"] += int((ad <= r * rms).sum())
        sq = ad.square()  # float32; sums in float64
        sq_sum += float(torch.sum(sq, dtype=torch.float64))
        max_abs = max(max_abs, float(ad.max()))
        hist.add(sq)
        del sq, ad
    s.update({k: float(v) for k, v in cnt.items()})
    s["base_rms"] = rms
    s["sq_sum"] = sq_sum
    s["max_abs"] = max_abs
    if n:
        ks = {p: max(1, int(math.floor(p / 100 * n + 0.5))) for p in ENERGY_TOP_PERCENT}
        # exact sums of the k largest squares; nothing to resolve when no delta is non-zero
        top = hist.top_sums(ks.values()) if s["sq_sum"] > 0 else {}
        for p, k in ks.items():
            s[f"energy_top_{p:g}pct"] = top[k] / s["sq_sum"] if s["sq_sum"] > 0 else float("nan")
    del hist
    svd = base.dim() == 2 and 0 < n <= svd_max_numel
    if not (need_delta or svd):
        return s, None
    if isinstance(base, LazyTensor):
        base = base.full()
    delta = tuned.to(torch.float32) - base.to(torch.float32)  # same shape as base
    if svd:
        t0 = time.perf_counter()
        s.update(svd_stats(delta))
        if clock is not None:  # where the job's time went: the spectra apart (diff.timing's parts)
            clock["spectra"] = clock.get("spectra", 0.0) + time.perf_counter() - t0
    return s, delta


def svd_stats(delta: torch.Tensor) -> dict[str, float]:
    """Numerical rank and top-k singular-value energy shares of a 2-D delta (m, n)."""
    sv = torch.linalg.svdvals(delta.to(torch.float32))  # (min(m, n),)
    m, n = delta.shape
    out: dict[str, float] = {}
    smax = float(sv[0]) if sv.numel() else 0.0
    tol = max(m, n) * torch.finfo(torch.float32).eps * smax
    out["rank"] = float((sv > tol).sum()) if smax > 0 else 0.0
    out["rank_max"] = float(min(m, n))
    energy = sv.double().pow(2)
    total = float(energy.sum())
    for k in SVD_TOPK:
        out[f"svd_top{k}_energy"] = float(energy[:k].sum()) / total if total > 0 else float("nan")
    return out


def _fractions(counts: Mapping[str, float]) -> dict[str, float]:
    """Unchanged fractions from summed counts, plus delta RMS."""
    n = counts["numel"]
    out = {"numel": n}
    for lab in threshold_labels():
        out[f"unchanged_{lab}"] = counts[f"unchanged_{lab}"] / n if n else float("nan")
    out["changed_exact"] = 1.0 - out["unchanged_exact"] if n else float("nan")
    out["changed_below_half_ulp"] = counts.get("changed_below_half_ulp", 0.0) / n if n else float("nan")
    for k in ("zero_in_base", "changed_from_zero"):  # fractions of all coordinates
        out[k] = counts.get(k, 0.0) / n if n else float("nan")
    out["delta_rms"] = math.sqrt(counts["sq_sum"] / n) if n else float("nan")
    out["max_abs_delta"] = counts["max_abs"]
    return out


# ---------------------------------------------------------------------------------------------
# Whole checkpoints
# ---------------------------------------------------------------------------------------------


@dataclass
class CheckpointDiff:
    per_tensor: dict[str, dict[str, float]]  # name -> fractions + tensor stats
    groups: dict[str, dict[str, dict[str, float]]]  # grouping -> group -> fractions
    skipped: dict[str, str] = field(default_factory=dict)  # name -> why (non-float tensors)
    fisher: dict[str, Any] | None = None  # compute.sparsity.overlap.score_vs_target output (+ "changed")
    delta: dict[str, torch.Tensor] | None = None  # fp32 deltas when keep_delta
    settings: dict[str, Any] = field(default_factory=dict)
    # stored dtypes of both sides and the convention of "unchanged_common" (comparison_convention)
    precision: dict[str, Any] = field(default_factory=dict)
    spectra_seconds: float = 0.0  # of the comparison's time, the 2-D deltas' singular values


def diff_checkpoints(
    base: Any,
    tuned: Any,
    fisher: Mapping[str, torch.Tensor] | None = None,
    topk_percent: float = 1.0,
    keep_delta: bool = False,
    svd_max_numel: int = SVD_MAX_NUMEL,
    progress: Progress | None = None,
    within: Mapping[str, torch.Tensor] | None = None,
) -> CheckpointDiff:
    """Update sparsity of `tuned` relative to `base` (each a Checkpoint, a model reference string,
    a folder, an nn.Module or a state dict). ValueError for different architectures.
    within: the mask `tuned` was trained inside: the Fisher-vs-delta metrics are computed over its
    coordinates only (compute.contract.construction), the sparsity counts over all."""
    src_b, src_t = as_source(base, "base"), as_source(tuned, "tuned")
    check_same_architecture(src_b, src_t)
    names = src_b.names()
    if fisher is not None:
        _check_fisher_fits(fisher, src_b, names)
    per_tensor: dict[str, dict[str, float]] = {}
    raw: dict[str, dict[str, float]] = {}
    skipped: dict[str, str] = {}
    abs_delta: dict[str, torch.Tensor] = {}
    base_w: dict[str, torch.Tensor] = {}
    deltas: dict[str, torch.Tensor] = {}
    dtypes: tuple[set[str], set[str]] = (set(), set())
    clock: dict[str, float] = {}
    for i, n in enumerate(names):
        if progress:
            progress(0.9 * i / max(1, len(names)), f"diff {n}")
        whole = keep_delta or (fisher is not None and n in fisher)  # |delta| and w kept per tensor
        tb = src_b.lazy(n) if hasattr(src_b, "lazy") and not whole else src_b.get(n)
        tt = src_t.get(n)
        if not (tb.is_floating_point() and tt.is_floating_point()):
            skipped[n] = f"not a float tensor ({src_b.dtype(n)})"
            continue
        dtypes[0].add(str(tb.dtype).replace("torch.", ""))
        dtypes[1].add(str(tt.dtype).replace("torch.", ""))
        want = keep_delta or (fisher is not None and n in fisher and tb.dtype == tt.dtype)
        stats, delta = tensor_diff_stats(tb, tt, svd_max_numel, need_delta=want, clock=clock)
        raw[n] = stats
        per_tensor[n] = {**_fractions(stats), **{k: v for k, v in stats.items()
                                                   if k.startswith(("energy_", "svd_", "rank"))}}
        per_tensor[n]["base_rms"] = stats["base_rms"]
        if fisher is not None and n in fisher:
            if tb.dtype == tt.dtype and delta is not None:
                abs_delta[n] = delta.abs()
            else:  # the precision policy: "changed" and |delta| in the lower stored precision
                low = lower_precision(tb.dtype, tt.dtype)
                abs_delta[n] = (tt.to(low).float() - tb.to(low).float()).abs()
            base_w[n] = tb
        if keep_delta and delta is not None:
            deltas[n] = delta
    groups = _group_fractions(raw)
    fisher_res = None
    if fisher is not None:
        if progress:
            progress(0.92, "Fisher vs |delta| overlap")
        if within is not None:  # the coordinates free to move (compute.contract.construction)
            from compute.sparsity.overlap import restrict

            abs_delta, base_w = restrict(abs_delta, within), restrict(base_w, within)
            fisher = restrict({n: fisher[n] for n in fisher if n in within}, within)
            if not abs_delta:
                raise ValueError("mask: no coordinate of the checkpoints is inside the mask")
        fisher_res = fisher_vs_delta(fisher, abs_delta, topk_percent)
        fisher_res["changed_by_weight_binade"] = fisher_auc_by_weight_binade(
            fisher, {n: d > 0 for n, d in abs_delta.items()}, base_w)
    settings = _diff_settings(svd_max_numel, topk_percent)
    return CheckpointDiff(per_tensor, groups, skipped, fisher_res, deltas if keep_delta else None, settings,
                          comparison_convention(*dtypes), spectra_seconds=clock.get("spectra", 0.0))


def _check_fisher_fits(fisher: Mapping[str, torch.Tensor], src: Any, names: list[str]) -> None:
    """ValueError naming the first Fisher tensor that is not in the checkpoints or has another
    shape there (compute.contract.shapes.mismatch)."""
    from compute.contract.shapes import mismatch, shapes_of

    why = mismatch(shapes_of(fisher), {n: src.shape(n) for n in names}, "the Fisher", "the checkpoints")
    if why:
        raise ValueError(f"fisher: {why}")


def _group_fractions(raw: Mapping[str, dict[str, float]]) -> dict[str, dict[str, dict[str, float]]]:
    """grouping -> group -> fractions, from the per-tensor counts summed over the group
    (max_abs: the maximum)."""
    groups: dict[str, dict[str, dict[str, float]]] = {}
    for grouping in GROUPINGS:
        acc: dict[str, dict[str, float]] = {}
        for n, st in raw.items():
            a = acc.setdefault(group_key(n, grouping), {})
            for k, v in st.items():
                if k in ("numel", "sq_sum", "changed_below_half_ulp", "zero_in_base", "changed_from_zero") \
                        or k.startswith("unchanged_"):
                    a[k] = a.get(k, 0.0) + v
                elif k == "max_abs":
                    a[k] = max(a.get(k, 0.0), v)
        groups[grouping] = {g: _fractions(c) for g, c in acc.items()}
    return groups


def _diff_settings(svd_max_numel: int, topk_percent: float) -> dict[str, Any]:
    """The conventions a diff result was computed with (stored with it, shown in reports)."""
    return {
        "atols": list(ATOLS),
        "rel_tols": list(REL_TOLS),
        "rel_tol_reference": "rms of the base tensor",
        "delta_dtype": "float32",
        "atol_convention": "unchanged_atol_<a>: |tuned - base| <= a with the delta in float32",
        "bf16delta_convention": "unchanged_bf16delta_atol_<a>: both checkpoints loaded in bfloat16, "
                                "|tuned_bf16 - base_bf16| <= a computed in bfloat16 (the published "
                                "convention of sparsity_in_rl, arXiv 2505.11711)",
        "half_ulp": "unchanged_below_half_ulp: float32 |delta| < half a bf16 ULP of |w_base| "
                    "(2^(e-9) for |w| = m 2^e, m in [0.5, 1))",
        "bf16_equality": "both tensors cast to bfloat16, then compared",
        "common_equality": "unchanged_common: exact equality when both tensors are stored in one "
                           "dtype, else both cast to the lower of the two precisions",
        "rank_tolerance": RANK_RTOL_DOC,
        "svd_topk": list(SVD_TOPK),
        "svd_max_numel": svd_max_numel,
        "energy_top_percent": list(ENERGY_TOP_PERCENT),
        "topk_percent": topk_percent,
    }


def fisher_vs_delta(fisher: Mapping[str, torch.Tensor], abs_delta: Mapping[str, torch.Tensor],
                    topk_percent: float) -> dict[str, Any]:
    """score_vs_target(Fisher, |delta|) at top-k%, plus AUC/precision for "changed at all"."""
    from compute.sparsity.overlap import score_vs_target

    fisher = {n: fisher[n].float().to(abs_delta[n].device) for n in abs_delta}
    res = score_vs_target(fisher, abs_delta, topk_percent / 100.0)
    changed = {n: d > 0 for n, d in abs_delta.items()}
    n_changed = sum(int(c.sum()) for c in changed.values())
    total = sum(c.numel() for c in changed.values())
    if 0 < n_changed < total:
        ch = score_vs_target(fisher, abs_delta, topk_percent / 100.0, by=("global",), target_set=changed)
        # precision of the top-|changed| Fisher coordinates against the changed set
        from compute.sparsity.overlap import precision_at_k

        res["changed"] = {
            "n_changed": n_changed,
            "auc": ch["global"]["all"]["auc"],
            "precision_at_n_changed": precision_at_k(fisher, changed),
        }
    else:
        res["changed"] = {"n_changed": n_changed, "auc": float("nan"), "precision_at_n_changed": float("nan")}
    return res


def fisher_auc_by_weight_binade(
    fisher: Mapping[str, torch.Tensor],
    changed: Mapping[str, torch.Tensor],
    base: Mapping[str, torch.Tensor],
    min_each: int = 10,
) -> dict[str, Any]:
    """ROC-AUC of the Fisher for "changed" within bins of |w| of equal bf16 ULP (binades
    [2^(e-1), 2^e), i.e. the exponent e of |w| = m 2^e, m in [0.5, 1); w == 0 is its own bin).

    Inside one binade every weight has the same bf16 ULP, so the bf16 rounding threshold cannot
    explain which coordinates changed: the AUC there is Fisher's predictive power net of the
    precision effect. Bins with fewer than `min_each` changed or unchanged coordinates get no AUC.
    `pooled_auc` weights each bin's AUC by its n_changed * n_unchanged pairs (the AUC over pairs
    that share a binade). fisher/changed/base: name -> tensors of equal shapes.
    """
    from compute.sparsity.overlap import roc_auc

    scores: dict[int, list[torch.Tensor]] = {}
    labels: dict[int, list[torch.Tensor]] = {}
    for n in fisher:
        if n not in changed or n not in base:
            continue
        w = base[n].detach().to(torch.float32).flatten().cpu()
        _, e = torch.frexp(w)
        e = torch.where(w == 0, torch.full_like(e, -1000), e)
        f = fisher[n].detach().to(torch.float32).flatten().cpu()
        c = changed[n].detach().flatten().bool().cpu()
        for v in torch.unique(e).tolist():
            sel = e == v
            scores.setdefault(int(v), []).append(f[sel])
            labels.setdefault(int(v), []).append(c[sel])
    bins = []
    num = den = 0.0
    for v in sorted(scores):
        s, lab = torch.cat(scores[v]), torch.cat(labels[v])
        n_pos = int(lab.sum())
        n_neg = int(lab.numel()) - n_pos
        auc = roc_auc(s, lab) if min(n_pos, n_neg) >= min_each else float("nan")
        lo, hi = (0.0, 0.0) if v == -1000 else (2.0 ** (v - 1), 2.0**v)
        bins.append({"exponent": v, "abs_w_lo": lo, "abs_w_hi": hi, "n": int(lab.numel()),
                     "n_changed": n_pos, "auc": auc})
        if math.isfinite(auc):
            num += auc * n_pos * n_neg
            den += n_pos * n_neg
    return {"bins": bins, "pooled_auc": num / den if den else float("nan"),
            "min_each": min_each, "binning": "binades of |w| (equal bf16 ULP)"}
