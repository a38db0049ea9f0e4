"""Job `diff`: update sparsity between two checkpoints, optionally against a Fisher."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from compute.contract.jobresult import Heatmap, JobResult, LayerStat, SeriesPoint, null_progress
from compute.contract.kinds import Refs
from compute.jobs.artifact_files import load_scores, resolved_refs
from compute.jobs.diff import DiffSpec
from compute.lm.cells import cells_heatmap, ratio_heatmap
from compute.lm.naming import layer_index, module_type
from compute.lm.naming import layer_sort_key as _layer_sort
from compute.sparsity.diff import (
    ATOLS,
    REL_TOLS,
    diff_checkpoints,
    open_checkpoint,
    threshold_labels,
)

OVERLAP_KEYS = ("precision_at_k", "auc", "jaccard", "jaccard_baseline", "jaccard_lift", "spearman",
                "overlap", "n_a", "n_b", "n")


def _threshold_meta(label: str, precision: dict[str, Any] | None = None) -> dict[str, Any]:
    if label == "common":  # the headline convention: first in the figure (meta "headline")
        low = (precision or {}).get("comparison_dtype", "the stored dtype")
        exact = (precision or {}).get("comparison", "").startswith("exact")
        return {"threshold": 0.0, "headline": True,
                "threshold_label": f"exact equality ({low})" if exact else
                f"equality in {low} (the lower stored precision)"}
    if label == "exact":
        if (precision or {}).get("rule") == "cast":  # compute.contract.precision: a counter-number
            return {"threshold": 0.0, "threshold_label": "exact equality across precisions (storage "
                                                         "rounding counts as a change)"}
        return {"threshold": 0.0, "threshold_label": "exact equality"}
    if label == "bf16":
        return {"threshold_label": "equal after casting both to bf16"}
    if label.startswith("atol_"):
        return {"threshold": float(label[5:]), "threshold_label": f"|delta_fp32| <= {label[5:]}",
                "convention": "float32 delta"}
    if label.startswith("bf16delta_atol_"):
        a = label[len("bf16delta_atol_"):]
        return {"threshold": float(a), "threshold_label": f"|delta_bf16| <= {a} (published convention)",
                "convention": "both checkpoints in bf16 (sparsity_in_rl)"}
    if label == "below_half_ulp":
        return {"threshold_label": "|delta_fp32| < half a bf16 ULP of |w|"}
    return {"relative": float(label[4:]), "threshold_label": f"|delta| <= {label[4:]} x rms(base)"}


def _overlap_rows(fisher_res: dict[str, Any], topk_percent: float) -> list[dict[str, Any]]:
    rows = []
    for grouping, prefix in (("global", ""), ("module", "module "), ("layer", "layer ")):
        items = sorted(fisher_res[grouping].items(),
                       key=lambda kv: _layer_sort(kv[0]) if grouping == "layer" else (0, 0))
        for g, m in items:
            row = {"scope": "global" if grouping == "global" else f"{prefix}{g}", "k_percent": topk_percent}
            row.update({k: m[k] for k in OVERLAP_KEYS})
            row["jaccard_random"] = m["jaccard_baseline"]
            rows.append(row)
    return rows


def _finite(x: float) -> float | None:
    return x if isinstance(x, (int, float)) and math.isfinite(x) else None


def run(spec: DiffSpec, progress: Any = null_progress, refs: Refs | None = None) -> JobResult:
    t0 = time.perf_counter()
    progress(0.0, "opening checkpoints")
    refs = resolved_refs(spec, refs)
    base = open_checkpoint(refs["base"], "base")
    tuned = open_checkpoint(refs["tuned"], "tuned")
    fisher_ref = refs.get("fisher")
    fisher = load_scores(fisher_ref, "fisher") if fisher_ref is not None else None
    within, construction = trained_mask(tuned.folder, fisher_ref) if fisher is not None else (None, None)
    t_open = time.perf_counter()
    res = diff_checkpoints(base, tuned, fisher=fisher, topk_percent=spec.topk_percent,
                           keep_delta=spec.store_delta, svd_max_numel=spec.svd_max_numel,
                           progress=progress, within=within)
    progress(0.95, "summarising")
    g = res.groups["global"]["all"]
    summary = _summary(spec, res)
    heatmaps: list[Heatmap] = []
    if construction is not None:
        summary["construction"] = construction
    if res.fisher is not None:
        summary.update(_fisher_summary(spec, res.fisher))
        heatmaps += _fisher_heatmaps(res.fisher, spec.topk_percent)
    if fisher_ref is not None:  # issue 18: the verdict of the Fisher this diff is scored against
        from compute.jobs.artifact_files import fisher_provenance

        summary["fisher_reliability"] = fisher_provenance(fisher_ref)
    heatmaps += _sparsity_heatmaps(res)
    series = [SeriesPoint("unchanged/atol", a, g[f"unchanged_atol_{a:g}"]) for a in ATOLS]
    series += [SeriesPoint("unchanged/atol_bf16delta", a, g[f"unchanged_bf16delta_atol_{a:g}"]) for a in ATOLS]
    series += [SeriesPoint("unchanged/rel_rms", r, g[f"unchanged_rel_{r:g}"]) for r in REL_TOLS]
    tensors = {"delta": res.delta} if res.delta is not None else {}
    # where the time went, by diff.timing's parts (the summary's assembly with the comparison)
    summary["seconds_parts"] = {"open": round(t_open - t0, 3),
                                "compare": round(time.perf_counter() - t_open - res.spectra_seconds, 3),
                                "spectra": round(res.spectra_seconds, 3)}
    progress(1.0, "done")
    return JobResult(kind="diff", summary=summary, layer_stats=_layer_rows(res), heatmaps=heatmaps,
                     series=series, tensors=tensors)


def trained_mask(folder: Path, fisher_ref: Any) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(mask, compute.contract.construction.scope) of a model a train job trained inside a mask
    (its OUT/mask.safetensors, compute.jobs.train_run._save_trained_mask), or (None, None). The
    scope says whether `fisher_ref` is the Fisher the mask was chosen from (sha256 of both)."""
    import json

    from compute.contract.construction import MASK_FILE, scope
    from compute.sparsity.masks import load_mask, mask_density, mask_metadata

    path = Path(folder) / MASK_FILE
    if not path.is_file():
        return None, None
    if mask_metadata(path).get("trained_inside") != "1":
        # `fisherlens train --out` also writes the job's tensors there (a mask built in the job):
        # the same mask, when the folder's metrics.json says the run trained inside one
        try:
            trained_in = "mask" in json.loads((Path(folder) / "metrics.json").read_text())
        except (OSError, ValueError):
            trained_in = False
        if not trained_in:
            return None, None
    mask = load_mask(path)
    try:
        rel = json.loads(mask_metadata(path).get("fisher_reliability") or "{}")
    except ValueError:
        rel = {}
    return mask, scope(True, density=mask_density(mask), mask_fisher_sha256=rel.get("source_sha256"),
                       fisher_sha256=getattr(fisher_ref, "sha256", None),
                       mask_label="the mask the tuned model was trained inside")


def _summary(spec: DiffSpec, res: Any) -> dict[str, Any]:
    """The key numbers of a diff: update sparsity at every threshold, per module, ranks."""
    g = res.groups["global"]["all"]
    summary: dict[str, Any] = {
        "base": spec.base,
        "tuned": spec.tuned,
        "n_params": int(g["numel"]),
        "tensors": len(res.per_tensor),
        # issue 18: the headline counts "unchanged" in the convention that fits the stored dtypes
        "update_sparsity": g["unchanged_common"],
        "changed_fraction": 1.0 - g["unchanged_common"],
        **res.precision,  # stored_dtypes {base, tuned}, comparison_dtype, comparison
        "compute_dtype": "float32",  # the delta and every |delta| threshold
        "stored_dtype": "float32",  # the delta artifact (store_delta)
        **{f"unchanged_{lab}": g[f"unchanged_{lab}"] for lab in threshold_labels()},
        "changed_below_half_ulp": g["changed_below_half_ulp"],
        "zero_in_base": g["zero_in_base"],  # fractions: exactly 0 in the base, and of those changed
        "changed_from_zero": g["changed_from_zero"],
        "conventions": {
            "unchanged_atol_<a>": "float32 delta |tuned - base| <= a",
            "unchanged_bf16delta_atol_<a>": "published convention (sparsity_in_rl): both checkpoints "
                                            "loaded in bf16, |tuned_bf16 - base_bf16| <= a",
            "unchanged_below_half_ulp": "float32 |delta| < half a bf16 ULP of |w_base|",
        },
        "delta_rms": g["delta_rms"],
        "max_abs_delta": g["max_abs_delta"],
        "by_module_unchanged_exact": {m: v["unchanged_exact"] for m, v in res.groups["module"].items()},
        "by_module_unchanged_common": {m: v["unchanged_common"] for m, v in res.groups["module"].items()},
        "skipped": res.skipped,
        "settings": res.settings,
    }
    ranks = [(n, v) for n, v in res.per_tensor.items() if "rank" in v]
    if ranks:
        summary["mean_relative_rank"] = sum(v["rank"] / v["rank_max"] for _, v in ranks) / len(ranks)
    return summary


def _fisher_summary(spec: DiffSpec, fr: dict[str, Any]) -> dict[str, Any]:
    """Fisher vs |delta|: overlap rows, global metrics, AUC for "changed" within weight binades."""
    gl = fr["global"]["all"]
    return {
        "overlap": _overlap_rows(fr, spec.topk_percent),
        "fisher": spec.fisher,
        "precision_at_k": gl["precision_at_k"],
        "auc": gl["auc"],
        "jaccard": gl["jaccard"],
        "jaccard_random": gl["jaccard_baseline"],
        "spearman": gl["spearman"],
        "changed_auc": fr["changed"]["auc"],
        "changed_precision": fr["changed"]["precision_at_n_changed"],
        "changed_auc_within_weight_binades": fr["changed_by_weight_binade"]["pooled_auc"],
        "changed_auc_by_weight_binade": fr["changed_by_weight_binade"]["bins"],
        "overlap_settings": fr["settings"],
    }


def _metric_of(metric: str) -> Callable[[dict[str, Any]], float | None]:
    """A heatmap cell's value: its finite `metric`."""
    return lambda cell: _finite(cell[metric])


def _fisher_heatmaps(fr: dict[str, Any], topk_percent: float) -> list[Heatmap]:
    """layer x module heatmaps of the Fisher-vs-|delta| metrics (compute.lm.cells.cells_heatmap
    over the overlap's "layer/module" groups)."""
    cells = {_layer_module(k): v for k, v in fr["layer_module"].items()}
    cells = dict(sorted(cells.items(), key=lambda kv: (kv[0][0] is None, kv[0][0] or 0)))
    return [
        cells_heatmap(f"fisher_vs_delta_{metric}", cells, _metric_of(metric),
                      {"units": metric, "topk_percent": topk_percent})
        for metric in ("jaccard_lift", "auc", "precision_at_k")
    ]


def _layer_module(key: str) -> tuple[int | None, str]:
    """'3/q' -> (3, 'q'); '-/embed' -> (None, 'embed') (compute.sparsity.masks.group_key's labels)."""
    lay, mod = key.split("/")
    return (None if lay == "-" else int(lay)), mod


def _sparsity_heatmaps(res: Any) -> list[Heatmap]:
    """Unchanged fraction per layer x module at each threshold, and per layer across thresholds."""
    numel = {n: v["numel"] for n, v in res.per_tensor.items()}
    out = []
    for lab in threshold_labels():
        key = f"unchanged_{lab}"
        out.append(ratio_heatmap(
            f"update_sparsity_{lab}", {n: (v[key] * numel[n], numel[n]) for n, v in res.per_tensor.items()},
            {"units": "unchanged fraction", "zmin": 0.0, "zmax": 1.0, **_threshold_meta(lab, res.precision)},
        ))
    layers = sorted(res.groups["layer"], key=_layer_sort)
    out.append(Heatmap(
        name="threshold_profile", x_labels=threshold_labels(), y_labels=layers,
        z=[[res.groups["layer"][lay][f"unchanged_{lab}"] for lab in threshold_labels()] for lay in layers],
        meta={"x_title": "threshold", "y_title": "layer", "units": "unchanged fraction",
              "zmin": 0.0, "zmax": 1.0},
    ))
    return out


def _layer_rows(res: Any) -> list[LayerStat]:
    """One row per tensor, then one per layer x module group."""
    rows = [LayerStat(param=n, module=module_type(n), layer=layer_index(n),
                      values={k: float(v) for k, v in vals.items()})
            for n, vals in res.per_tensor.items()]
    for key, vals in res.groups["layer_module"].items():
        lay, mod = _layer_module(key)
        rows.append(LayerStat(param="", module=mod, layer=lay,
                              values={k: float(v) for k, v in vals.items()}, group="layer_module"))
    return rows
