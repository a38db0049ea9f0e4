"""The few numbers a researcher opens a result for, per job kind, read from its stored summary.

`key_numbers(result)` -> {"items": [{"label", "value", "note"}], "warnings": [str],
"verdict": {"level": "good" | "fair" | "poor" | "none", "text"} | None,
"table": {"title", "headers", "rows"} | None}. Values are formatted
strings (4 significant digits); a number the result does not hold is left out, never guessed.
Pure: the same result dict as `GET /api/results/{token}` (or `JobResult.to_dict()`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

# Split-half top-k Jaccard: two independent halves of the samples should select the same top-k
# coordinates. >= 0.8: the top set is stable; 0.5..0.8: usable for aggregates (layer x module),
# not for single coordinates; < 0.5: the estimate is mostly sampling noise: take more samples.
RELIABLE_JACCARD = 0.8
FAIR_JACCARD = 0.5

Item = dict[str, str]


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or v is None:
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def fmt(v: Any) -> str:
    f = _num(v)
    if f is None:
        return "n/a"
    if f == 0:
        return "0"
    if abs(f) < 1e-3 or abs(f) >= 1e5:
        return f"{f:.3e}"
    return f"{f:.4g}"


def pct(v: Any) -> str:
    f = _num(v)
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
                                     f"samples{vs}"}


def _fisher(result: dict[str, Any], out: dict[str, Any]) -> None:
    s = result.get("summary") or {}
    items = out["items"]
    if _num(s.get("top1%_share")) is not None:
        items.append(_item("Fisher mass in the top 1% of coordinates", pct(s["top1%_share"]),
                           "uniform would be 1%"))
    if _num(s.get("top10%_share")) is not None:
        items.append(_item("Fisher mass in the top 10%", pct(s["top10%_share"])))
    if _num(s.get("gini")) is not None:
        items.append(_item("Gini coefficient", fmt(s["gini"]), "0 = uniform, 1 = one coordinate"))
    k = _num(s.get("split_half_topk_percent"))
    jac = _num(s.get("split_half_jaccard"))
    if jac is not None:
        items.append(_item(f"Split-half top-{fmt(k)}% Jaccard", fmt(jac),
                           "two independent halves of the samples"))
    if "split_half_jaccard" in s:
        out["verdict"] = jaccard_verdict(jac, k)
    if s.get("n_samples") is not None:
        items.append(_item("Samples", fmt(s["n_samples"]), str(s.get("estimator") or "")))
    exact = s.get("exact_output")
    if isinstance(exact, dict) and exact:
        errs = [e for v in exact.values() if isinstance(v, dict)
                if (e := _num(v.get("relative_l1_error"))) is not None]
        if errs:
            items.append(_item("Output layer: relative L1 error vs exact", fmt(max(errs)),
                               "largest over the output-layer tensors"))


def _first_last(result: dict[str, Any], name: str) -> tuple[float, float, float, float] | None:
    pts = sorted((float(p["step"]), v) for p in result.get("series") or []
                 if p.get("name") == name and (v := _num(p.get("value"))) is not None)
    if len(pts) < 2:
        return None
    return pts[0][0], pts[0][1], pts[-1][0], pts[-1][1]


def _train(result: dict[str, Any], out: dict[str, Any]) -> None:
    s = result.get("summary") or {}
    items = out["items"]
    before, after = _num(s.get("accuracy_before")), _num(s.get("accuracy_after"))
    if before is not None and after is not None:
        n = (s.get("eval") or {}).get("prompts") if isinstance(s.get("eval"), dict) else None
        note = f"greedy, {n} held-out prompts" if n else "greedy, held-out prompts"
        items.append(_item("Held-out accuracy before -> after",
                           f"{pct(before)} -> {pct(after)} ({'+' if after >= before else ''}"
                           f"{100 * (after - before):.3g} points)", note))
        if after <= before:
            out["warnings"].append("Training did not improve held-out accuracy.")
    fl = _first_last(result, "train/reward")
    if fl is not None:
        items.append(_item("Sample reward, first -> last step",
                           f"{fmt(fl[1])} -> {fmt(fl[3])}", f"steps {fmt(fl[0])} and {fmt(fl[2])}"))
    if _num(s.get("trainable_fraction")) is not None:
        items.append(_item("Trainable fraction (mask density)", pct(s["trainable_fraction"])))
    us = s.get("update_sparsity")
    if isinstance(us, dict) and _num(us.get("unchanged_exact")) is not None:
        items.append(_item("Weights exactly unchanged", pct(us["unchanged_exact"])))


def _unchanged_table(s: dict[str, Any]) -> dict[str, Any] | None:
    """Unchanged fraction at each threshold: one row per threshold; a second column when the
    summary also has the bf16-checkpoint convention (|bf16(tuned) - bf16(base)| <= a)."""
    keys = [k for k, v in s.items() if k.startswith("unchanged_") and _num(v) is not None]
    bf16 = {k[len("unchanged_bf16delta_atol_"):]: s[k] for k in keys if k.startswith("unchanged_bf16delta_atol_")}
    rows: list[list[str]] = []
    for k in keys:
        lab = k[len("unchanged_"):]
        if lab.startswith("bf16delta_atol_"):
            continue  # shown next to the float32 row of the same atol
        if lab == "exact":
            label = "exactly equal"
        elif lab == "bf16":
            label = "equal after casting both to bf16"
        elif lab.startswith("atol_"):
            label = f"|delta| <= {lab[5:]}"
        elif lab.startswith("rel_"):
            label = f"|delta| <= {lab[4:]} x rms(base tensor)"
        elif lab == "below_half_ulp":
            label = "|delta| < half a bf16 ULP of |base weight|"
        else:
            label = lab.replace("_", " ")
        row = [label, pct(s[k])]
        if bf16:
            row.append(pct(bf16[lab[5:]]) if lab.startswith("atol_") and lab[5:] in bf16 else "")
        rows.append(row)
    if not rows:
        return None
    headers = ["threshold", "unchanged"]
    if bf16:
        headers = ["threshold", "unchanged (float32 delta)", "unchanged (both loaded in bf16)"]
    return {"title": "Unchanged fraction by threshold", "headers": headers, "rows": rows}


def _diff(result: dict[str, Any], out: dict[str, Any]) -> None:
    s = result.get("summary") or {}
    items = out["items"]
    if _num(s.get("unchanged_exact")) is not None:
        items.append(_item("Weights exactly unchanged", pct(s["unchanged_exact"]),
                           "every threshold in the table below"))
    if _num(s.get("auc")) is not None:
        settings: dict[str, Any] = s.get("overlap_settings") or {}
        rows: list[Any] = s.get("overlap") or []
        if not isinstance(settings, dict) or not isinstance(rows, list):
            settings, rows = {}, []
        k = settings.get("topk_percent") or next(
            (r.get("k_percent") for r in rows if isinstance(r, dict) and r.get("k_percent")), None)
        top = f"top-{fmt(k)}%" if k is not None else "top-k"
        items.append(_item(f"Fisher AUC for the {top} |delta| coordinates", fmt(s["auc"]),
                           "0.5 = chance, 1 = the Fisher ranks them all first"))
    if _num(s.get("changed_auc")) is not None:
        items.append(_item("Fisher AUC for changed-at-all coordinates", fmt(s["changed_auc"]),
                           "0.5 = chance"))
    if "auc" not in s:
        items.append(_item("Fisher AUC", "not computed", "the diff was run without a Fisher"))
    out["table"] = _unchanged_table(s)


def _retention(result: dict[str, Any], out: dict[str, Any]) -> None:
    s = result.get("summary") or {}
    base, full = _num(s.get("base_reward")), _num(s.get("full_reward_mean"))
    spread = _num(s.get("full_reward_std"))
    if base is not None:
        out["items"].append(_item("Base model held-out reward", fmt(base)))
    if full is not None:
        out["items"].append(_item("Full training held-out reward",
                                  fmt(full) + (f" +- {fmt(spread)}" if spread is not None else ""),
                                  f"{len(s.get('full_rewards') or [])} seeds"))
    if s.get("retention_valid") is False and s.get("warning"):  # compute.retention's own test
        out["warnings"].append(f"No retention reported: {s['warning']}")
    elif base is not None and full is not None:
        if full <= base:
            out["warnings"].append(
                f"Full training did not beat the base model (full {fmt(full)} <= base {fmt(base)}): "
                "retention = (masked - base) / (full - base) has no meaning here.")
        elif spread is not None and full - base <= spread:
            out["warnings"].append(
                f"Full training beat the base by {fmt(full - base)}, within one seed spread "
                f"({fmt(spread)}): retention ratios are noisy.")
    rows = [r for r in s.get("rows") or [] if isinstance(r, dict)]
    if rows and "retention_ci" in rows[0]:  # ratio of means with bootstrap intervals
        conf = f"{float(s.get('confidence') or 0.95):.0%}"

        def ci(v: Any) -> str:
            return f"[{fmt(v[0])}, {fmt(v[1])}]" if isinstance(v, list) and len(v) == 2 else "n/a"

        out["table"] = {
            "headers": ["selector", "density", f"held-out reward [{conf} CI]", "retention",
                        f"{conf} CI (seeds + prompts)"],
            "rows": [[str(r.get("selector")), fmt(r.get("density")), f"{fmt(r.get('reward_mean'))} {ci(r.get('reward_ci'))}",
                      fmt(r.get("retention")), ci(r.get("retention_ci"))] for r in rows],
        }
        return
    out["table"] = {
        "title": "Retention by selector and density (mean +- spread over seeds)",
        "headers": ["selector", "density", "held-out reward", "retention", "retention of means"],
        "rows": [[str(r.get("selector")), fmt(r.get("density")),
                  f"{fmt(r.get('reward_mean'))} +- {fmt(r.get('reward_std'))}",
                  f"{fmt(r.get('retention_mean'))} +- {fmt(r.get('retention_std'))}",
                  fmt(r.get("retention_of_means"))] for r in rows],
    }


def _mask(result: dict[str, Any], out: dict[str, Any]) -> None:
    s = result.get("summary") or {}
    if _num(s.get("density")) is not None:
        out["items"].append(_item("Kept fraction", pct(s["density"]),
                                  f"selector {s.get('select')}, asked {pct(s.get('density_requested'))}"))
    if _num(s.get("fisher_mass_kept")) is not None:
        out["items"].append(_item("Fisher mass kept", pct(s["fisher_mass_kept"])))


def _tokens(result: dict[str, Any], out: dict[str, Any]) -> None:
    s = result.get("summary") or {}
    top = [r for r in s.get("top_tokens") or [] if isinstance(r, dict)]
    if top:
        best = max(top, key=lambda r: _num(r.get("prob")) or 0.0)
        out["items"].append(_item("Most likely next token", repr(str(best.get("token", ""))),
                                  f"p = {fmt(best.get('prob'))}"))
    if _num(s.get("entropy")) is not None:
        out["items"].append(_item("Next-token entropy", fmt(s["entropy"]), "nats"))


KINDS: dict[str, Callable[[dict[str, Any], dict[str, Any]], None]] = {
    "fisher": _fisher, "train": _train, "diff": _diff, "retention": _retention, "mask": _mask,
    "tokens": _tokens,
}


def key_numbers(result: dict[str, Any]) -> dict[str, Any]:
    kind = result.get("kind") or (result.get("job") or {}).get("kind")
    out: dict[str, Any] = {"items": [], "warnings": [], "verdict": None, "table": None}
    fn = KINDS.get(str(kind))
    if fn is not None:
        fn(result, out)
    return out
