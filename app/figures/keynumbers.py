"""The few numbers a researcher opens a result for, per job kind, read from its stored summary.

`key_numbers(result)` -> {"items": [{"label", "value", "note"}], "warnings": [str],
"verdict": {"level": "good" | "fair" | "poor" | "none", "text"} | None,
"table": {"title", "headers", "rows"} | None}. Values are formatted
strings (4 significant digits); a number the result does not hold is left out, never guessed.
Pure: the same result dict as `GET /api/results/{token}` (or `JobResult.to_dict()`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from app.figures.common import finite
from compute.contract.results import (
    FAIR_JACCARD,
    KINDS,
    RELIABLE_JACCARD,
    TRAIN,
    DiffResult,
    DiffSummary,
    FisherResult,
    MaskResult,
    RetentionResult,
    RetentionRow,
    SweepResult,
    TokensResult,
    TrainResult,
    TypedResult,
    parse_result,
)

# the thresholds of the split-half verdict (FAIR_JACCARD, RELIABLE_JACCARD) live with the results

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


def _item(label: str, value: str, note: str = "") -> Item:
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
                                     f"samples (rerun with until_reliable, CLI --until-reliable){vs}"}


def _fisher(r: FisherResult, out: dict[str, Any]) -> None:
    s = r.summary
    items = out["items"]
    if finite(s.top1_share) is not None:
        items.append(_item("Fisher mass in the top 1% of coordinates", pct(s.top1_share), "uniform would be 1%"))
    if finite(s.top10_share) is not None:
        items.append(_item("Fisher mass in the top 10%", pct(s.top10_share)))
    if finite(s.gini) is not None:
        items.append(_item("Gini coefficient", fmt(s.gini), "0 = uniform, 1 = one coordinate"))
    k, jac = finite(s.split_half_topk_percent), finite(s.split_half_jaccard)
    if jac is not None:
        items.append(_item(f"Split-half top-{fmt(k)}% Jaccard", fmt(jac), "two independent halves of the samples"))
    if "split_half_jaccard" in s.model_fields_set:
        out["verdict"] = jaccard_verdict(jac, k)
    if s.n_samples is not None:
        items.append(_item("Samples", fmt(s.n_samples), str(s.estimator or "")))
    perr = s.precision_error or {}
    if finite(perr.get("relative_l1")) is not None:
        out["warnings"].append(
            f"Computed in {s.compute_dtype}: relative L1 error {fmt(perr['relative_l1'])} against float32 "
            f"(worst tensor {fmt(perr.get('worst_tensor_relative_l1'))}, top-{fmt(perr.get('topk_percent'))}% "
            f"overlap {fmt(perr.get('topk_jaccard'))}) on the same {perr.get('rows')} completions; "
            "rerun with dtype float32 for the exact Fisher.")
    errs = [e for v in (s.exact_output or {}).values() if (e := finite(v.relative_l1_error)) is not None]
    if errs:
        items.append(_item("Output layer: relative L1 error vs exact", fmt(max(errs)),
                           "largest over the output-layer tensors"))


def _train(r: TrainResult, out: dict[str, Any]) -> None:
    s = r.summary
    items = out["items"]
    before, after = finite(s.accuracy_before), finite(s.accuracy_after)
    if before is not None and after is not None:
        n = (s.eval or {}).get("prompts")
        note = f"greedy, {n} held-out prompts" if n else "greedy, held-out prompts"
        items.append(_item("Held-out accuracy before -> after",
                           f"{pct(before)} -> {pct(after)} ({'+' if after >= before else ''}"
                           f"{100 * (after - before):.3g} points)", note))
        if after <= before:
            out["warnings"].append("Training did not improve held-out accuracy.")
    curve = r.curves(TRAIN).get("reward")
    if curve is not None and len(curve[0]) >= 2:
        (xs, ys) = curve
        items.append(_item("Sample reward, first -> last step", f"{fmt(ys[0])} -> {fmt(ys[-1])}",
                           f"steps {fmt(xs[0])} and {fmt(xs[-1])}"))
    if finite(s.trainable_fraction) is not None:
        items.append(_item("Trainable fraction (mask density)", pct(s.trainable_fraction)))
    us = s.update_sparsity or {}
    if finite(us.get("unchanged_exact")) is not None:
        # both sides are the stored weights (the base rounded like the checkpoint): exact fits
        dt = us.get("stored_dtype")
        note = f"{dt} checkpoint vs the base stored alike" if dt else ""
        items.append(_item("Stored weights exactly unchanged", pct(us["unchanged_exact"]), note))
    _bound_item(r, out)


def _bound_item(r: TrainResult, out: dict[str, Any]) -> None:
    """Violations of |g| <= sqrt(E A^2) sqrt(F) against the independent Fisher: the same
    sentence as the bound figure's title (app.figures.train.bound_holds_text)."""
    from app.figures.train import bound_holds_text

    b = r.summary.bound or {}
    if "bound_violations" not in b:
        return
    text = bound_holds_text(r)
    if text:
        v = b["bound_violations"]
        out["items"].append(_item("Cauchy-Schwarz bound, first batch", f"{v:,} violations",
                                  text + "; Fisher from independent samples"))


THRESHOLD_NAMES = {"exact": "exactly equal", "bf16": "equal after casting both to bf16",
                   "below_half_ulp": "|delta| < half a bf16 ULP of |base weight|"}
BF16_DELTA = "bf16delta_atol_"


def _threshold_name(lab: str) -> str:
    if lab in THRESHOLD_NAMES:
        return THRESHOLD_NAMES[lab]
    if lab.startswith("atol_"):
        return f"|delta| <= {lab[5:]}"
    if lab.startswith("rel_"):
        return f"|delta| <= {lab[4:]} x rms(base tensor)"
    return lab.replace("_", " ")


def _exact_comparison(s: DiffSummary) -> bool:
    return (s.comparison or "exact").startswith("exact")


def _common_name(s: DiffSummary) -> str:
    return f"equal in {s.comparison_dtype} (the lower stored precision)"


def _unchanged_table(s: DiffSummary) -> dict[str, Any] | None:
    """Unchanged fraction at each threshold: one row per threshold; a second column when the
    summary also has the bf16-checkpoint convention (|bf16(tuned) - bf16(base)| <= a)."""
    unchanged = s.unchanged()
    if "common" in unchanged:  # the headline convention leads the table too
        unchanged = {"common": unchanged.pop("common"), **unchanged}
    bf16 = {lab[len(BF16_DELTA):]: v for lab, v in unchanged.items() if lab.startswith(BF16_DELTA)}
    rows: list[list[str]] = []
    for lab, v in unchanged.items():
        if lab.startswith(BF16_DELTA):
            continue  # shown next to the float32 row of the same atol
        if lab == "common" and _exact_comparison(s):
            continue  # the same numbers as the "exactly equal" row
        row = [_common_name(s) if lab == "common" else _threshold_name(lab), pct(v)]
        if bf16:
            row.append(pct(bf16[lab[5:]]) if lab.startswith("atol_") and lab[5:] in bf16 else "")
        rows.append(row)
    if not rows:
        return None
    headers = ["threshold", "unchanged"]
    if bf16:
        headers = ["threshold", "unchanged (float32 delta)", "unchanged (both loaded in bf16)"]
    return {"title": "Unchanged fraction by threshold", "headers": headers, "rows": rows}


def _diff(r: DiffResult, out: dict[str, Any]) -> None:
    s = r.summary
    items = out["items"]
    if finite(s.unchanged_common) is not None and not _exact_comparison(s):
        sd = s.stored_dtypes or {}
        items.append(_item(f"Weights unchanged, compared in {s.comparison_dtype}", pct(s.unchanged_common),
                           f"base stored in {sd.get('base')}, tuned in {sd.get('tuned')}: compared at the "
                           f"lower precision (exact equality across precisions: {pct(s.unchanged_exact)})"))
    elif finite(s.unchanged_exact) is not None:
        note = (f"both stored in {s.comparison_dtype}; every threshold in the table below"
                if s.comparison_dtype else "every threshold in the table below")
        items.append(_item("Weights exactly unchanged", pct(s.unchanged_exact), note))
    if finite(s.auc) is not None:
        k = (s.overlap_settings or {}).get("topk_percent") or next(
            (row.get("k_percent") for row in s.overlap or [] if row.get("k_percent")), None)
        top = f"top-{fmt(k)}%" if k is not None else "top-k"
        items.append(_item(f"Fisher AUC for the {top} |delta| coordinates", fmt(s.auc),
                           "0.5 = chance, 1 = the Fisher ranks them all first"))
    if finite(s.changed_auc) is not None:
        items.append(_item("Fisher AUC for changed-at-all coordinates", fmt(s.changed_auc), "0.5 = chance"))
    if "auc" not in s.model_fields_set:
        items.append(_item("Fisher AUC", "not computed", "the diff was run without a Fisher"))
    out["table"] = _unchanged_table(s)


def _retention_warning(r: RetentionResult, out: dict[str, Any]) -> None:
    s = r.summary
    base, full, spread = finite(s.base_reward), finite(s.full_reward_mean), finite(s.full_reward_std)
    if s.retention_valid is False and s.warning:  # compute.retention's own test
        out["warnings"].append(f"No retention reported: {s.warning}")
    elif base is not None and full is not None:
        if full <= base:
            out["warnings"].append(
                f"Full training did not beat the base model (full {fmt(full)} <= base {fmt(base)}): "
                "retention = (masked - base) / (full - base) has no meaning here.")
        elif spread is not None and full - base <= spread:
            out["warnings"].append(
                f"Full training beat the base by {fmt(full - base)}, within one seed spread "
                f"({fmt(spread)}): retention ratios are noisy.")


def _ci(v: Any) -> str:
    return f"[{fmt(v[0])}, {fmt(v[1])}]" if isinstance(v, list) and len(v) == 2 else "n/a"


def _retention_table(rows: list[RetentionRow], confidence: float | None) -> dict[str, Any]:
    if rows and "retention_ci" in rows[0].model_fields_set:  # ratio of means with bootstrap intervals
        conf = f"{float(confidence or 0.95):.0%}"
        return {
            "headers": ["selector", "density", f"held-out reward [{conf} CI]", "retention",
                        f"{conf} CI (seeds + prompts)"],
            "rows": [[row.selector, fmt(row.density), f"{fmt(row.reward_mean)} {_ci(row.reward_ci)}",
                      fmt(row.retention), _ci(row.retention_ci)] for row in rows],
        }
    return {
        "title": "Retention by selector and density (mean +- spread over seeds)",
        "headers": ["selector", "density", "held-out reward", "retention", "retention of means"],
        "rows": [[row.selector, fmt(row.density), f"{fmt(row.reward_mean)} +- {fmt(row.reward_std)}",
                  f"{fmt(row.retention_mean)} +- {fmt(row.retention_std)}", fmt(row.retention_of_means)]
                 for row in rows],
    }


def _retention(r: RetentionResult, out: dict[str, Any]) -> None:
    s = r.summary
    base, full, spread = finite(s.base_reward), finite(s.full_reward_mean), finite(s.full_reward_std)
    if base is not None:
        out["items"].append(_item("Base model held-out reward", fmt(base)))
    if full is not None:
        out["items"].append(_item("Full training held-out reward",
                                  fmt(full) + (f" +- {fmt(spread)}" if spread is not None else ""),
                                  f"{len(s.full_rewards or [])} seeds"))
    _retention_warning(r, out)
    out["table"] = _retention_table(list(s.rows), s.confidence)


def _mask(r: MaskResult, out: dict[str, Any]) -> None:
    s = r.summary
    if finite(s.density) is not None:
        out["items"].append(_item("Kept fraction", pct(s.density),
                                  f"selector {s.select}, asked {pct(s.density_requested)}"))
    if finite(s.fisher_mass_kept) is not None:
        out["items"].append(_item("Fisher mass kept", pct(s.fisher_mass_kept)))


def _tokens(r: TokensResult, out: dict[str, Any]) -> None:
    s = r.summary
    if s.top_tokens:
        best = max(s.top_tokens, key=lambda t: finite(t.prob) or 0.0)
        out["items"].append(_item("Most likely next token", repr(best.token), f"p = {fmt(best.prob)}"))
    if finite(s.entropy) is not None:
        out["items"].append(_item("Next-token entropy", fmt(s.entropy), "nats"))


def _sweep(r: SweepResult, out: dict[str, Any]) -> None:
    pts = r.summary.points
    if not pts:
        return
    out["items"].append(_item("Points (lr x optimizer x precision)", str(len(pts))))
    out["table"] = {
        "title": "Unchanged fraction (bf16) and Fisher AUC per point",
        "headers": ["precision", "optimizer", "lr", "unchanged (bf16)", "Fisher AUC changed", "reward after"],
        "rows": [[p.precision, p.optimizer, f"{p.lr:g}", pct(p.unchanged_bf16), fmt(p.fisher_auc_changed),
                  pct(p.reward_after)] for p in pts],
    }


BUILDERS: dict[str, Callable[[Any, dict[str, Any]], None]] = {
    "fisher": _fisher, "train": _train, "diff": _diff, "retention": _retention, "mask": _mask,
    "tokens": _tokens, "sweep": _sweep,
}


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
        out["items"].append(_item("Precision", f"base {sd.get('base')}, tuned {sd.get('tuned')}",
                                  f"stored dtypes; compared in {s.comparison_dtype}, deltas in "
                                  f"{s.compute_dtype or 'float32'}"))
        return
    if s.compute_dtype or s.stored_dtype:
        bits = [f"computed in {s.compute_dtype}" if s.compute_dtype else "",
                f"stored in {s.stored_dtype}" if s.stored_dtype else ""]
        err = r.raw_summary.get("precision_error") or {}
        note = (f"vs float32 on the same samples: relative L1 {fmt(err.get('relative_l1'))}, worst tensor "
                f"{fmt(err.get('worst_tensor_relative_l1'))}" if finite(err.get("relative_l1")) is not None else "")
        out["items"].append(_item("Precision", ", ".join(b for b in bits if b), note))


def key_numbers(result: TypedResult[Any] | Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"items": [], "warnings": [], "verdict": None, "table": None}
    kind = result.kind if isinstance(result, TypedResult) else (
        result.get("kind") or (result.get("job") or {}).get("kind"))
    if kind in KINDS:
        r = parse_result(result)
        BUILDERS[kind](r, out)
        rel = r.summary.fisher_reliability
        if rel and out["verdict"] is None:  # a mask, train, diff ... shows its Fisher's verdict
            out["verdict"] = fisher_verdict(rel)
        _precision_item(r, out)
    return out
