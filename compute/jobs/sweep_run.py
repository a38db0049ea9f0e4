"""Job `sweep`: update sparsity and the Fisher's predictive power across learning rate x optimizer
x precision (docs/science.md section 6).

Each grid point is one unit (a child job when queued, so N workers run N points at once;
compute.jobs.runners' protocol): one `train` run (compute.jobs.train_run, same seed, so every point sees the
same prompts) followed by a diff of its stored checkpoint against the base's stored checkpoint (both
in the precision's stored dtype). `combine` gathers the points in grid order; `run` (the CLI, or a
job that is not fanned out) is `combine` over every unit run in this process.

The initial Fisher, shared by all points, comes from samples independent of every run's training
batches (or is given). A unit may run on another machine, so each unit estimates it itself from the
spec's seed: the estimate is deterministic (per-row sampling seeds, compute.lm.sampling), the same in
every unit (bit for bit on one machine; tests check it). It is not a first unit of its own, because
every point would wait for it; it costs `fisher_prompts x fisher_samples` sampled completions with
one backward each (128 at the defaults) against `steps x batch x group` completions (1,280) and two
held-out evaluations per point. In one process `shared` keeps it, so `run` estimates it once. Unit 0
also returns it, so the job's result keeps the Fisher its AUCs used. Each point records:

- `unchanged_exact` (stored dtype), `unchanged_bf16` (both cast to bf16), the published-convention
  `unchanged_bf16delta_atol_1e-05` and the float32-delta `unchanged_atol_1e-05`, and
  `changed_below_half_ulp` (float32 delta != 0 but below half a bf16 ULP of |w|);
- `fisher_auc_changed`: ROC-AUC of the initial Fisher for "stored weight changed";
  `fisher_auc_changed_within_binades`: the same within bins of equal bf16 ULP (net of the
  precision effect), with the per-binade AUCs;
- `fisher_auc_gradient` / `fisher_precision_gradient` / `fisher_spearman_gradient`: the initial
  Fisher against sum over the run of g^2 (top-k% set), and `fisher_auc_abs_delta` against |delta|;
- reward before and after: held-out greedy accuracy (`reward_before`, `reward_after`) and the
  sampled training reward of the first and last steps.
"""

from __future__ import annotations

import math
import shutil
import time
from pathlib import Path
from typing import Any

from compute.contract.cost import merge_length_records
from compute.contract.jobresult import Heatmap, JobResult, SeriesPoint, null_progress
from compute.contract.kinds import Refs
from compute.contract.results import sum_parts
from compute.jobs.artifact_files import resolved_refs
from compute.jobs.sweep import SweepSpec
from compute.jobs.train import TrainSpec

POINT_KEYS = (
    "lr", "optimizer", "precision", "unchanged_exact", "unchanged_bf16", "unchanged_bf16delta_atol_1e-05",
    "unchanged_atol_1e-05", "changed_below_half_ulp", "fisher_auc_changed",
    "fisher_auc_changed_within_binades", "fisher_auc_gradient", "fisher_precision_gradient",
    "fisher_spearman_gradient", "fisher_auc_abs_delta", "reward_before", "reward_after",
    "train_reward_first", "train_reward_last", "seconds",
)
TRAIN_FIELDS = ("model", "task", "algo", "teacher", "steps", "batch", "group", "max_new_tokens",
                "eval_prompts", "seed", "weight_decay", "momentum", "grad_clip", "temperature",
                "kl_coef", "clip_eps", "sft_source", "distill_estimator", "fisher_prompts",
                "fisher_samples", "independent_fisher", "topk_percent", "device", "gradient_checkpointing")


def grid(spec: SweepSpec) -> list[tuple[str, str, float]]:
    """(precision, optimizer, lr) of every point, in run order."""
    return [(p, o, lr) for p in spec.precision for o in spec.optimizers for lr in spec.lrs]


def point_spec(spec: SweepSpec, precision: str, optimizer: str, lr: float) -> TrainSpec:
    """The train spec of one grid point (no bound check: it does not depend on lr)."""
    data = {f: getattr(spec, f) for f in TRAIN_FIELDS}
    return TrainSpec.model_validate({**data, "lr": lr, "optimizer": optimizer, "precision": precision,
                                     "bound": False, "concentration": True})


def _num(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and math.isfinite(float(x)) else None


def _binomial_se(p: Any, n: Any) -> float | None:
    if not isinstance(p, (int, float)) or not isinstance(n, int) or n < 1 or not math.isfinite(float(p)):
        return None
    return math.sqrt(float(p) * (1 - float(p)) / n)


def point_row(precision: str, optimizer: str, lr: float, summary: dict[str, Any]) -> dict[str, Any]:
    us = summary.get("update_sparsity", {})
    conc = summary.get("concentration", {})
    gsq = conc.get("grad_sq_sum", {}).get("global", {})
    dlt = conc.get("abs_delta", {}).get("global", {})
    row: dict[str, Any] = {
        "lr": lr, "optimizer": optimizer, "precision": precision,
        "stored_dtype": us.get("stored_dtype"),
        "unchanged_exact": us.get("unchanged_exact"),
        # the headline policy (compute.contract.precision): in the lower of the base's and the
        # checkpoint's precisions (compute.jobs.train_run._headline_convention)
        "unchanged_common": us.get("unchanged_common", us.get("unchanged_exact")),
        "comparison_dtype": us.get("comparison_dtype"),
        "unchanged_bf16": us.get("unchanged_bf16"),
        "unchanged_bf16delta_atol_1e-05": us.get("unchanged_bf16delta_atol_1e-05"),
        "unchanged_atol_1e-05": us.get("unchanged_atol_1e-05"),
        "changed_below_half_ulp": us.get("changed_below_half_ulp"),
        # weights exactly 0 in the base, and those the run changed (any nonzero update shows)
        "zero_in_base": us.get("zero_in_base"),
        "changed_from_zero": us.get("changed_from_zero"),
        "fisher_auc_changed": us.get("fisher_auc_changed"),
        "fisher_auc_changed_within_binades": us.get("fisher_auc_changed_within_binades"),
        "fisher_auc_changed_by_binade": us.get("fisher_auc_changed_by_binade"),
        "fisher_auc_gradient": gsq.get("auc"),
        "fisher_precision_gradient": gsq.get("precision_at_k"),
        "fisher_spearman_gradient": gsq.get("spearman"),
        "fisher_auc_abs_delta": dlt.get("auc"),
        "reward_before": summary.get("accuracy_before"),
        "reward_after": summary.get("accuracy_after"),
        # one binomial standard error of each accuracy over the held-out prompts
        "reward_before_se": _binomial_se(summary.get("accuracy_before"), (summary.get("eval") or {}).get("prompts")),
        "reward_after_se": _binomial_se(summary.get("accuracy_after"), (summary.get("eval") or {}).get("prompts")),
        "train_reward_first": summary.get("reward_first"),
        "train_reward_last": summary.get("reward_last"),
        "seconds": summary.get("seconds"),
    }
    return {k: (_num(v) if isinstance(v, float) else v) for k, v in row.items()}


def markdown_table(points: list[dict[str, Any]]) -> str:
    """The sweep as a markdown table (fractions with 3 decimals, '-' where undefined; pipes in
    headers escaped)."""
    cols = [("precision", "precision"), ("optimizer", "optimizer"), ("lr", "lr"),
            ("unchanged_common", "unchanged (lower stored precision)"), ("comparison_dtype", "compared in"),
            ("unchanged_bf16", "unchanged (bf16)"), ("unchanged_exact", "unchanged (stored, exact)"),
            ("unchanged_bf16delta_atol_1e-05", r"\|Δbf16\| ≤ 1e-5"),
            ("unchanged_atol_1e-05", r"\|Δfp32\| ≤ 1e-5"),
            ("fisher_auc_changed", "Fisher AUC changed"),
            ("fisher_auc_changed_within_binades", r"AUC changed within \|w\| binades"),
            ("fisher_auc_gradient", "Fisher AUC Σg² top-k"), ("reward_before", "reward before"),
            ("reward_after", "reward after")]

    def cell(k: str, v: Any) -> str:
        if v is None:
            return "-"
        if k == "lr":
            return f"{v:g}"
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    cols = [(k, t) for k, t in cols if any(p.get(k) is not None for p in points)]  # none: stored before
    lines = ["| " + " | ".join(t for _, t in cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(cell(k, p.get(k)) for k, _ in cols) + " |" for p in points]
    return "\n".join(lines) + "\n"


def _heatmaps(spec: SweepSpec, points: list[dict[str, Any]]) -> list[Heatmap]:
    out = []
    lr_labels = [f"{lr:g}" for lr in spec.lrs]
    for metric, units in (("unchanged_bf16", "unchanged fraction (bf16)"),
                          ("fisher_auc_changed", "ROC-AUC"), ("fisher_auc_gradient", "ROC-AUC")):
        for prec in spec.precision:
            z = [[next((p[metric] for p in points if p["precision"] == prec and p["optimizer"] == o
                        and p["lr"] == lr), None) for lr in spec.lrs] for o in spec.optimizers]
            out.append(Heatmap(name=f"sweep_{metric}_{prec}", x_labels=lr_labels, y_labels=list(spec.optimizers),
                               z=z, meta={"x_title": "learning rate", "y_title": "optimizer", "units": units,
                                          "precision": prec, "zmin": 0.0, "zmax": 1.0}))
    return out


def children(spec: SweepSpec) -> int:
    """Units of the sweep: one per grid point."""
    return len(grid(spec))


def initial_fisher(spec: SweepSpec, progress: Any = null_progress, refs: Refs | None = None
                   ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The sweep's initial Fisher and its description: the given file, or estimated from samples
    independent of the training batches, at the bf16-rounded base when every point starts there
    (no fp32 point), else at the float32 base. Deterministic: every unit gets the same one."""
    from compute.jobs.artifact_files import load_scores
    from compute.jobs.train_run import independent_fisher
    from compute.lm.causal_lm import load_model, resolve_device
    from compute.lm.verifiable_tasks import get_task
    from compute.train import prepare_precision

    fisher_ref = resolved_refs(spec, refs).get("fisher")
    if fisher_ref is not None:
        return load_scores(fisher_ref, "fisher"), {"source": "given", "file": spec.fisher}
    progress(0.0, "initial Fisher from independent samples")
    model_ref = resolved_refs(spec, refs).get("model")
    assert model_ref is not None  # the spec requires a model
    model, tok = load_model(model_ref, device=resolve_device(spec.device), dtype="float32")
    rounded = "fp32" not in spec.precision
    if rounded:
        prepare_precision(model, "bf16-mixed")
    probe = point_spec(spec, spec.precision[0], spec.optimizers[0], spec.lrs[0])
    fisher, info = independent_fisher(model, tok, get_task(spec.task), probe, progress)
    info["base_rounded_to_bf16"] = rounded
    return fisher, info


def run_child(spec: SweepSpec, index: int, progress: Any = null_progress,
              shared: dict[str, Any] | None = None, refs: Refs | None = None) -> dict[str, Any]:
    """One grid point: train + diff. Returns {"row": the point's row (POINT_KEYS), "initial_fisher":
    its description, "fisher": the Fisher tensors (unit 0, when estimated; else None), "seconds":
    the unit's wall time}.
    `shared`: the Fisher kept between units of one process (see the module docstring);
    `refs`: the resolved model and fisher (compute/jobs/runners.py)."""
    from compute.jobs.train_run import train_job

    t0 = time.perf_counter()
    pts = grid(spec)
    if not 0 <= index < len(pts):
        raise ValueError(f"index: got {index}; accepted range: 0 .. {len(pts) - 1}")
    prec, opt, lr = pts[index]
    label = f"point {index + 1}/{len(pts)}: {opt} lr {lr:g} {prec}"
    shared = {} if shared is None else shared
    # where the unit's time went, by the names of the kind's estimate (sweep.timing): the initial
    # Fisher in the unit that made it (its model load included), then the point's training run's
    # own parts, its diff and clean-up added to "finish"
    parts: dict[str, float] = {}
    if "fisher" not in shared:
        shared["fisher"] = initial_fisher(spec, lambda f, m="": progress(0.05 * f, f"{label}: {m}"), refs)
        parts["initial Fisher"] = time.perf_counter() - t0
    fisher, info = shared["fisher"]

    def sub(f: float, m: str = "") -> None:
        progress(0.05 + 0.95 * min(max(f, 0.0), 1.0), f"{label}: {m}" if m else label)

    model_refs = {"model": resolved_refs(spec, refs)["model"]}  # the Fisher is given above
    t1 = time.perf_counter()
    res = train_job(point_spec(spec, prec, opt, lr), sub, fisher=fisher, fisher_info=info, refs=model_refs)
    t2 = time.perf_counter()
    for k, v in (res.summary.get("seconds_parts") or {}).items():
        parts[k] = parts.get(k, 0.0) + float(v)
    folder = res.files.get("model")
    if folder:
        shutil.rmtree(Path(folder).parent, ignore_errors=True)
    row = point_row(prec, opt, lr, res.summary)
    un = row["unchanged_bf16"]
    progress(1.0, f"{label}: unchanged (bf16) {'-' if un is None else f'{un:.3f}'}")
    keep = index == 0 and not spec.fisher
    end = time.perf_counter()
    # the train's own account covers its wall time but for its result's assembly: that, and the
    # point's diff and clean-up, are the point's end
    parts["finish"] = parts.get("finish", 0.0) + max(0.0, t2 - t1 - sum(
        float(v) for v in (res.summary.get("seconds_parts") or {}).values())) + (end - t2)
    return {"row": row, "initial_fisher": dict(info), "fisher": dict(fisher) if keep else None,
            "seconds": end - t0, "seconds_parts": {k: round(v, 3) for k, v in parts.items()},
            "completion_lengths": res.summary.get("completion_lengths")}


def run(spec: SweepSpec, progress: Any = null_progress, refs: Refs | None = None) -> JobResult:
    """The whole sweep in this process: `combine` over every unit, the Fisher estimated once."""
    n = children(spec)
    shared: dict[str, Any] = {}

    def sub(i: int) -> Any:
        return lambda f, m="": progress((i + min(max(f, 0.0), 1.0)) / n, m)

    return combine(spec, [run_child(spec, i, sub(i), shared, refs) for i in range(n)], progress, refs=refs)


DEFINITIONS = {
    "unchanged_bf16": "fraction of coordinates equal after casting the base's and the run's stored "
                      "checkpoints to bf16",
    "unchanged_exact": "fraction bit-identical in the stored dtype (bf16 for bf16-mixed and bf16)",
    "unchanged_bf16delta_atol_1e-05": "published convention: both in bf16, |delta_bf16| <= 1e-5",
    "fisher_auc_changed": "ROC-AUC of the initial Fisher for 'stored weight changed'",
    "fisher_auc_changed_within_binades": "the same AUC over pairs sharing a |w| binade (equal bf16 "
                                         "ULP): Fisher's power net of the precision effect",
    "fisher_auc_gradient": "ROC-AUC of the initial Fisher for the top-k% of sum over the run of g^2",
    "reward_before/after": "held-out greedy accuracy of the base (at the point's precision) and "
                           "of the trained model",
    "seconds": "sum of the units' wall times, Fisher and evaluations included (less wall time when "
               "workers run points in parallel); a point's own seconds: its training loop",
}


def combine(spec: SweepSpec, outputs: list[Any], progress: Any = null_progress,
            refs: Refs | None = None) -> JobResult:
    """The sweep's JobResult from every point's output, in grid order (see `run_child`)."""
    pts = grid(spec)
    if len(outputs) != len(pts):
        raise ValueError(f"outputs: got {len(outputs)} points; the grid has {len(pts)}")
    points = [dict(o["row"]) for o in outputs]
    for (prec, opt, lr), p in zip(pts, points, strict=True):
        if (p["precision"], p["optimizer"], p["lr"]) != (prec, opt, lr):
            raise ValueError(f"outputs: point {p['optimizer']} lr {p['lr']:g} {p['precision']} is out of "
                             f"grid order (expected {opt} lr {lr:g} {prec})")
    summary: dict[str, Any] = {"model": spec.model, "task": spec.task, "algo": spec.algo,
                               "grid": {"lrs": list(spec.lrs), "optimizers": list(spec.optimizers),
                                        "precision": list(spec.precision)},
                               "initial_fisher": dict(outputs[0]["initial_fisher"])}
    # issue 18: precision per point is in the table; here the run-wide facts and the Fisher's verdict
    summary["compute_dtype"] = "per point (bfloat16 for precision bf16, else float32)"
    summary["stored_dtype"] = "per point (float32 for fp32, else bfloat16)"
    from compute.jobs.artifact_files import fisher_provenance

    fisher_ref = resolved_refs(spec, refs).get("fisher")
    if fisher_ref is not None:

        summary["fisher_reliability"] = fisher_provenance(fisher_ref)
    result = JobResult(kind="sweep", summary=summary)
    if outputs[0].get("fisher") is not None:
        result.tensors["fisher"] = dict(outputs[0]["fisher"])
    for row in points:
        for key in ("unchanged_bf16", "unchanged_exact", "fisher_auc_changed", "fisher_auc_gradient"):
            if row.get(key) is not None:
                result.series.append(SeriesPoint(f"sweep/{key}/{row['optimizer']} {row['precision']}",
                                                 row["lr"], row[key]))
    summary["points"] = points
    summary["markdown"] = markdown_table(points)
    summary["seconds"] = round(sum(float(o.get("seconds") or 0.0) for o in outputs), 1)
    summary["seconds_parts"] = sum_parts(outputs)
    lengths = merge_length_records([o["completion_lengths"] for o in outputs if o.get("completion_lengths")])
    if lengths is not None:  # every point's sampled completions (one max_new_tokens: the spec's)
        summary["completion_lengths"] = lengths
    summary["definitions"] = DEFINITIONS
    result.heatmaps += _heatmaps(spec, points)
    progress(1.0, f"{len(points)} points in {summary['seconds']:.0f} s")
    return result
