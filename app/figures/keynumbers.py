"""The few numbers a researcher opens a result for, read from its stored summary: the shared
formatting and verdicts here, each kind's builder in app/figures/<kind>.py (`@key_numbers(kind)`).

`key_numbers(result)` -> {"items": [{"label", "value", "note"}], "warnings": [str],
"verdict": {"level": "good" | "fair" | "poor" | "none", "text"} | None,
"table": {"title", "headers", "rows"} | None}. Values are formatted
strings (4 significant digits); a number the result does not hold is left out, never guessed.
Pure: the same result dict as `GET /api/results/{token}` (or `JobResult.to_dict()`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from app.figures.common import finite
from app.figures.registry import key_numbers_builder
from compute.contract.results import TypedResult, result_kind
from compute.jobs import registry

# Split-half top-k Jaccard: two independent halves of the samples should select the same top-k
# coordinates. >= 0.8: the top set is stable; 0.5..0.8: usable for aggregates (layer x module),
# not for single coordinates; < 0.5: the estimate is mostly sampling noise: take more samples.
RELIABLE_JACCARD = 0.8
FAIR_JACCARD = 0.5

Item = dict[str, str]


def fmt(v: Any) -> str:
    f = finite(v)
    if f is None:
        return "n/a"
    if f == 0:
        return "0"
    if abs(f) < 1e-3 or abs(f) >= 1e5:
        return f"{f:.3e}"
    return f"{f:.4g}"


def pct(v: Any) -> str:
    f = finite(v)
    if f is None:
        return "n/a"
    return f"{100 * f:.3g}%" if abs(100 * f) >= 0.01 or f == 0 else f"{100 * f:.2e}%"


def item(label: str, value: str, note: str = "") -> Item:
    return {"label": label, "value": value, "note": note}


def random_topk_jaccard(fraction: float) -> float:
    """Expected Jaccard of two independent uniformly random top-k sets holding `fraction` of
    the coordinates each (large n): |A & B| ~ p^2 n, |A | B| ~ (2p - p^2) n -> p / (2 - p)."""
    return fraction / (2.0 - fraction)


def jaccard_verdict(jaccard: float | None, topk_percent: float | None) -> dict[str, str]:
    if jaccard is None:
        return {"level": "none", "text": "no split-half check (the batch estimator keeps no halves)"}
    base = random_topk_jaccard(topk_percent / 100) if topk_percent else None
    vs = f" (random sets: {fmt(base)})" if base is not None else ""
    if jaccard >= RELIABLE_JACCARD:
        return {"level": "good", "text": f"reliable: the two halves agree on the top set{vs}"}
    if jaccard >= FAIR_JACCARD:
        return {"level": "fair", "text": "fair: trust layer x module aggregates, not single "
                                         f"coordinates; more samples would firm it up{vs}"}
    return {"level": "poor", "text": "unreliable: the top set is mostly sampling noise; take more "
                                     f"samples{vs}"}


def key_numbers(result: TypedResult[Any] | Mapping[str, Any]) -> dict[str, Any]:
    """The key numbers of a result: its kind's builder (`@key_numbers(kind)` in
    app/figures/<kind>.py) fills items, warnings, verdict and table; nothing for a kind without
    one (or an unknown kind)."""
    out: dict[str, Any] = {"items": [], "warnings": [], "verdict": None, "table": None}
    build = key_numbers_builder(result_kind(result))
    if build is not None:
        build(registry.parse_result(result), out)
    return out
