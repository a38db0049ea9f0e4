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

from app.ceiling import duration
from app.figures.common import finite
from app.figures.registry import key_numbers_builder
from app.render import significant
from compute.contract.results import FAIR_JACCARD, RELIABLE_JACCARD, TypedResult, result_kind
from compute.jobs import registry
from compute.jobs.diff import DiffSummary

# the thresholds of the split-half verdict (FAIR_JACCARD, RELIABLE_JACCARD) live with the results
# (compute.contract.results), re-exported here for the figures
__all__ = ["FAIR_JACCARD", "RELIABLE_JACCARD"]

Item = dict[str, str]


def fmt(v: Any) -> str:
    """A key number's value: "n/a" unless finite, else app.render.significant (as a table cell)."""
    f = finite(v)
    return "n/a" if f is None else significant(f)


def pct(v: Any) -> str:
    f = finite(v)
    if f is None:
        return "n/a"
    return f"{100 * f:.3g}%" if abs(100 * f) >= 0.01 or f == 0 else f"{100 * f:.2e}%"


def binomial_se(p: float | None, n: Any) -> float | None:
    """One standard error of an accuracy p measured on n prompts: sqrt(p (1 - p) / n) (the SE
    convention of every accuracy the pages show; docs/reading-results.md)."""
    f = finite(p)
    if f is None or not isinstance(n, int) or isinstance(n, bool) or n < 1:
        return None
    return (f * (1 - f) / n) ** 0.5


def pct_se(p: Any, se: Any) -> str:
    """'32% ± 3.3' (the SE in percentage points), or the bare percentage without an SE."""
    e = finite(se)
    return pct(p) if e is None else f"{pct(p)} ± {100 * e:.2g}"


def fmt_se(v: Any, se: Any) -> str:
    """'0.32 ± 0.033', or the bare value without an SE."""
    e = finite(se)
    return fmt(v) if e is None else f"{fmt(v)} ± {fmt(e)}"


def item(label: str, value: str, note: str = "") -> Item:
    return {"label": label, "value": value, "note": note}


def random_topk_jaccard(fraction: float) -> float:
    """Expected Jaccard of two independent uniformly random top-k sets holding `fraction` of
    the coordinates each (large n): |A & B| ~ p^2 n, |A | B| ~ (2p - p^2) n -> p / (2 - p)."""
    return fraction / (2.0 - fraction)


def jaccard_verdict(jaccard: float | None, topk_percent: float | None) -> dict[str, str]:
    """The split-half verdict: its text starts with its level's name (good, fair, poor), the one
    name the API, the UI and the docs use for it (issue 27; the UI said "unreliable")."""
    if jaccard is None:
        return {"level": "none", "text": "no split-half check (the batch estimator keeps no halves)"}
    base = random_topk_jaccard(topk_percent / 100) if topk_percent else None
    vs = f" (random sets: {fmt(base)})" if base is not None else ""
    if jaccard >= RELIABLE_JACCARD:
        return {"level": "good", "text": f"good: the two halves agree on the top set{vs}"}
    if jaccard >= FAIR_JACCARD:
        return {"level": "fair", "text": "fair: trust layer x module aggregates, not single "
                                         f"coordinates; more samples would firm it up{vs}"}
    return {"level": "poor", "text": "poor: the top set is mostly sampling noise; take more "
                                     f"samples (rerun with until_reliable, CLI --until-reliable){vs}"}


def fisher_verdict(rel: Mapping[str, Any]) -> dict[str, str]:
    """The verdict of the Fisher a result was built on (summary "fisher_reliability")."""
    src = rel.get("source") or "the Fisher"
    v = jaccard_verdict(finite(rel.get("split_half_jaccard")), finite(rel.get("split_half_topk_percent")))
    if rel.get("split_half_jaccard") is None and rel.get("note"):
        v = {"level": "none", "text": str(rel["note"])}
    return {"level": v["level"], "text": f"built on {src}: {v['text']}"}


def _precision_item(r: TypedResult[Any], out: dict[str, Any]) -> None:
    """Where a result says it, the precision it was computed and stored in (issue 18)."""
    s = r.summary
    if isinstance(s, DiffSummary) and s.stored_dtypes:
        sd = s.stored_dtypes
        out["items"].append(item("Precision", f"base {sd.get('base')}, tuned {sd.get('tuned')}",
                                 f"stored dtypes; compared in {s.comparison_dtype}, deltas in "
                                 f"{s.compute_dtype or 'float32'}"))
        return
    if s.compute_dtype or s.stored_dtype:
        bits = [f"computed in {s.compute_dtype}" if s.compute_dtype else "",
                f"stored in {s.stored_dtype}" if s.stored_dtype else ""]
        err = r.raw_summary.get("precision_error") or {}
        note = (f"vs float32 on the same samples: relative L1 {fmt(err.get('relative_l1'))}, worst tensor "
                f"{fmt(err.get('worst_tensor_relative_l1'))}" if finite(err.get("relative_l1")) is not None else "")
        out["items"].append(item("Precision", ", ".join(b for b in bits if b), note))


def _secs(v: float) -> str:
    return f"{v:.2g} s" if v < 10 else duration(v)


def _wall_seconds(job: Mapping[str, Any]) -> float | None:
    from datetime import datetime

    try:
        t0, t1 = (datetime.fromisoformat(str(job[k])) for k in ("started_at", "finished_at"))
    except (KeyError, TypeError, ValueError):
        return None
    return max(0.0, (t1 - t0).total_seconds())


def time_item(result: TypedResult[Any] | Mapping[str, Any]) -> Item | None:
    """What a job took, against what it was estimated to take when it was submitted, part by part
    (summary.seconds_parts uses its kind's estimate's part names; jobs.estimate keeps the
    estimate): every kind, one rule. None when the result holds neither."""
    if not isinstance(result, Mapping):
        return None
    job = result.get("job") or {}
    est = job.get("estimate") or {}
    took = dict((result.get("summary") or {}).get("seconds_parts") or {})
    wall = _wall_seconds(job)
    if wall is None and not took:
        return None
    total = wall if wall is not None else sum(float(v) for v in took.values())
    value = f"took {_secs(total)}"
    if est.get("seconds") is not None:
        value += f", estimated {_secs(float(est['seconds']))} at submit"
    guessed = dict(est.get("seconds_parts") or {})
    if not (took or guessed):
        return item("Time", value)
    if guessed:
        parts = [f"{p} {_secs(float(took[p])) if p in took else '-'} / {_secs(float(v))}" for p, v in guessed.items()]
        parts += [f"{p} {_secs(float(v))} / -" for p, v in took.items() if p not in guessed]
        note = "by part, took / estimated: " + "; ".join(parts)
    else:
        note = "by part: " + "; ".join(f"{p} {_secs(float(v))}" for p, v in took.items())
    if took and job.get("n_children"):
        note += " (the units' times added: they may have run on several workers at once)"
    return item("Time", value, note)


# A sampled completion that reaches max_new_tokens without its end-of-sequence token is cut: at or
# above this share of them, the result warns that what it measured is of cut completions
TRUNCATED_WARN_SHARE = 0.1


def completions_item(result: TypedResult[Any] | Mapping[str, Any]) -> tuple[Item | None, str | None]:
    """How long the job's sampled completions ran (summary.completion_lengths, recorded by every
    job that samples: compute.contract.cost.length_record): how many, their median length, the
    share cut at max_new_tokens; and a warning when that share is TRUNCATED_WARN_SHARE or more.
    (None, None) when the job sampled nothing."""
    if not isinstance(result, Mapping):
        return None, None
    rec = (result.get("summary") or {}).get("completion_lengths")
    if not isinstance(rec, Mapping) or not rec.get("rows"):
        return None, None
    rows, cut, limit = int(rec["rows"]), int(rec.get("open") or 0), int(rec["max_new_tokens"])
    seen, median = 0, None
    for k, v in sorted(((int(k), int(v)) for k, v in (rec.get("stopped") or {}).items())):
        seen += v
        if 2 * seen >= rows:
            median = k
            break
    mid = f"median {median} tokens" if median is not None else f"median at the limit ({limit} tokens or more)"
    share = cut / rows
    value = f"{rows:,} sampled, {mid}"
    note = (f"{pct(share)} reached max_new_tokens = {limit} without ending (cut there); a submitted "
            "job's lengths price the sampling of the next estimates on this model and task")
    warn = None
    if share >= TRUNCATED_WARN_SHARE:
        warn = (f"{pct(share)} of the sampled completions reached max_new_tokens = {limit} without ending: "
                "what this job measured is of completions cut there. Raise max_new_tokens to include the rest.")
    return item("Completions", value, note), warn


def key_numbers(result: TypedResult[Any] | Mapping[str, Any]) -> dict[str, Any]:
    """The key numbers of a result: its kind's builder (`@key_numbers(kind)` in
    app/figures/<kind>.py) fills items, warnings, verdict and table; nothing for a kind without
    one (or an unknown kind). Then, for every kind: the verdict of the Fisher a result was built
on (summary "fisher_reliability") when the builder gave none, the precision item, how long the
sampled completions ran (completions_item) and the time (time_item)."""
    out: dict[str, Any] = {"items": [], "warnings": [], "verdict": None, "table": None}
    build = key_numbers_builder(result_kind(result))
    if build is not None:
        r = registry.parse_result(result)
        build(r, out)
        rel = r.summary.fisher_reliability
        if rel and out["verdict"] is None:  # a mask, train, diff ... shows its Fisher's verdict
            out["verdict"] = fisher_verdict(rel)
        _precision_item(r, out)
    sampled, cut = completions_item(result)
    if sampled is not None:
        out["items"].append(sampled)
    if cut is not None:
        out["warnings"].append(cut)
    when = time_item(result)
    if when is not None:
        out["items"].append(when)
    return out
