"""The one headline policy for "unchanged" (issue 27): what every kind that counts unchanged
weights, draws an unchanged heatmap or prices a sparse sync must say, decided in one place.

- Two sides stored alike (both float32, both bfloat16): exact equality leads.
- Two sides stored at different precisions (an fp32 base against the bf16 checkpoints of a
  bf16-mixed run): every "unchanged" number, heatmap and sync-byte count is computed after
  casting both to the lower precision (fewer mantissa bits), and says so. Exact equality across
  precisions counts every weight that storage rounding moved as changed: a bf16-mixed run that
  trained 5% of its weights reads "0.06% unchanged" exactly and "95% unchanged" in bfloat16.
- A sparse sync (int32/int64 flat index + value per changed coordinate, values in the compared
  precision) is priced against the dense copy, and when it costs more the policy says that
  dense is cheaper: sparse is never shown as a saving when it is not one.

Used by compute.sparsity.diff (the diff and, through compute.jobs.train_run.update_sparsity, train
and sweep), compute.sparsity.series (the series), compute.integrations.trl (UpdateSparsityCallback)
and the figures (app/figures: key numbers, heatmap and figure titles of every kind). Pure: standard
library only (the web process imports it; dtypes are named by string).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

# mantissa bits (without the implicit one) of the float dtypes weights are stored in
MANTISSA_BITS = {"float64": 52, "float32": 23, "float16": 10, "bfloat16": 7,
                 "float8_e4m3fn": 3, "float8_e5m2": 2}
ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}
_ALIASES = {"f64": "float64", "f32": "float32", "f16": "float16", "bf16": "bfloat16", "fp32": "float32",
            "fp16": "float16", "double": "float64", "float": "float32", "half": "float16",
            "f8_e4m3": "float8_e4m3fn", "f8_e5m2": "float8_e5m2"}

EXACT = "exact"
CAST = "cast"


def dtype_name(dtype: Any) -> str:
    """'float32' for torch.float32, 'torch.float32', 'F32', 'fp32' ...; other names lower-cased."""
    s = str(dtype).replace("torch.", "").strip().lower()
    return _ALIASES.get(s, s)


def lower_precision(a: Any, b: Any) -> str:
    """The dtype with fewer mantissa bits of two float dtypes (a when equal): the precision two
    sides stored in `a` and `b` can both be compared in."""
    na, nb = dtype_name(a), dtype_name(b)
    if na == nb:
        return na
    ba, bb = MANTISSA_BITS.get(na, 99), MANTISSA_BITS.get(nb, 99)
    return na if ba <= bb else nb


def comparison(base_dtypes: Iterable[Any], tuned_dtypes: Iterable[Any],
               sides: tuple[str, str] = ("base", "tuned")) -> dict[str, Any]:
    """How two sides stored in these (float) dtypes count "unchanged":

    {"stored_dtypes": {side: "float32" | "bfloat16+float32" ...}, "comparison_dtype",
     "rule": "exact" | "cast", "comparison": the sentence a reader is shown}.
    Exact equality when both are stored alike in one dtype, else equality after casting both to
    the lower stored precision (per tensor: each tensor pair in the lower of its two dtypes)."""
    bs, ts = {dtype_name(d) for d in base_dtypes}, {dtype_name(d) for d in tuned_dtypes}

    def name(ds: set[str]) -> str:
        return "+".join(sorted(ds)) or "none"

    out: dict[str, Any] = {"stored_dtypes": {sides[0]: name(bs), sides[1]: name(ts)}}
    if bs == ts and len(bs) <= 1:
        d = name(bs)
        out.update(comparison_dtype=d, rule=EXACT,
                   comparison=f"exact equality: both {sides[0]} and {sides[1]} are stored in {d}")
        return out
    lows = {lower_precision(a, b) for a in bs for b in ts}
    low = name(lows) if len(lows) > 1 else next(iter(lows), "none")
    out.update(comparison_dtype=low if len(lows) == 1 else f"per tensor ({low})", rule=CAST,
               comparison=f"both cast to {low}, the lower of the stored precisions ({sides[0]} "
                          f"{name(bs)}, {sides[1]} {name(ts)}): exact equality across precisions "
                          "would count every weight that storage rounding moved as changed")
    return out


def merge(comparisons: Iterable[dict[str, Any] | None]) -> dict[str, Any] | None:
    """One comparison for several pairs (a series' points): exact only when every pair is; the
    stored dtypes and comparison dtypes joined."""
    cs = [c for c in comparisons if c]
    if not cs:
        return None
    if len({(c["rule"], c["comparison_dtype"], tuple(sorted(c["stored_dtypes"].items()))) for c in cs}) == 1:
        return dict(cs[0])
    casts = [c for c in cs if c["rule"] == CAST]
    first = dict(casts[0] if casts else cs[0])
    lows = sorted({c["comparison_dtype"] for c in casts}) if casts else [first["comparison_dtype"]]
    first["comparison_dtype"] = "+".join(lows)
    if casts:
        first["comparison"] = (f"where the two sides are stored at different precisions, both cast to "
                               f"{first['comparison_dtype']} (the lower one); exact equality where they "
                               "are stored alike")
    return first


def is_exact(c: dict[str, Any] | None) -> bool:
    """Exact equality is the headline (both sides stored alike, or nothing known)."""
    return not c or c.get("rule", EXACT) == EXACT


def unchanged_label(c: dict[str, Any] | None, what: str = "Weights unchanged") -> str:
    """The headline's label: 'Weights exactly unchanged' / 'Weights unchanged, compared in bfloat16'."""
    if is_exact(c):
        head, _, tail = what.partition(" unchanged")
        return f"{head} exactly unchanged{tail}"
    assert c is not None
    return f"{what}, compared in {c['comparison_dtype']}"


def unchanged_units(c: dict[str, Any] | None) -> str:
    """A heatmap's colour-bar units / a curve's name for the headline convention."""
    return "unchanged fraction (exact)" if is_exact(c) else \
        f"unchanged fraction (compared in {c['comparison_dtype']})"  # type: ignore[index]


def index_bytes(numel: int) -> int:
    """Bytes of one flat index into a tensor of `numel` elements: int32 below 2^31, else int64."""
    return 4 if numel < 2**31 else 8


def sparse_sync_bytes(changed: float, numel: int, value_dtype: Any) -> float:
    """Indices + values of the changed coordinates of one tensor, values in `value_dtype`."""
    return float(changed) * (index_bytes(numel) + ITEMSIZE.get(dtype_name(value_dtype), 4))


def sync_verdict(sparse_bytes: float | None, dense_bytes: float | None) -> dict[str, Any] | None:
    """{"cheaper": "sparse" | "dense", "ratio": sparse / dense, "text"}: what a sparse sync costs
    against the dense copy, and which one a reader should use; None without both numbers."""
    if sparse_bytes is None or not dense_bytes:
        return None
    ratio = sparse_bytes / dense_bytes
    if ratio < 1:
        return {"cheaper": "sparse", "ratio": ratio,
                "text": f"sparse (indices + values) costs {100 * ratio:.3g}% of the dense bytes"}
    return {"cheaper": "dense", "ratio": ratio,
            "text": f"dense is cheaper: sparse (indices + values) would cost {ratio:.3g}x the dense bytes"}
