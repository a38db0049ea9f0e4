"""Job `sweep`: update sparsity and the Fisher's predictive power across learning rate x optimizer
x precision (SCIENCE.md section 6).

One initial Fisher is estimated once, from samples independent of every run's training batches
(or given), and shared by all points. Each grid point is one `train` run (compute.run_train, same
seed, so every point sees the same prompts) followed by a diff of its stored checkpoint against the
base's stored checkpoint (both in the precision's stored dtype). Points run one after the other in
this job, with progress per point; each point records:

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

from compute.results import Heatmap, JobResult, SeriesPoint, null_progress
from compute.specs import SweepSpec, TrainSpec

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
                "fisher_samples", "independent_fisher", "topk_percent", "device")


def grid(spec: SweepSpec) -> list[tuple[str, str, float]]:
    """(precision, optimizer, lr) of every point, in run order."""
    return [(p, o, lr) for p in spec.precision for o in spec.optimizers for lr in spec.lrs]


def point_spec(spec: SweepSpec, precision: str, optimizer: str, lr: float) -> TrainSpec:
    """The train spec of one grid point (no bound check: it does not depend on lr)."""
    data = {f: getattr(spec, f) for f in TRAIN_FIELDS}
    return TrainSpec(**data, lr=lr, optimizer=optimizer, precision=precision, bound=False,
                     concentration=True)


def _num(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and math.isfinite(float(x)) else None


def point_row(precision: str, optimizer: str, lr: float, summary: dict[str, Any]) -> dict[str, Any]:
    us = summary.get("update_sparsity", {})
    conc = summary.get("concentration", {})
    gsq = conc.get("grad_sq_sum", {}).get("global", {})
    dlt = conc.get("abs_delta", {}).get("global", {})
    row: dict[str, Any] = {
        "lr": lr, "optimizer": optimizer, "precision": precision,
        "stored_dtype": us.get("stored_dtype"),
        "unchanged_exact": us.get("unchanged_exact"),
        "unchanged_bf16": us.get("unchanged_bf16"),
        "unchanged_bf16delta_atol_1e-05": us.get("unchanged_bf16delta_atol_1e-05"),
        "unchanged_atol_1e-05": us.get("unchanged_atol_1e-05"),
        "changed_below_half_ulp": us.get("changed_below_half_ulp"),
        "fisher_auc_changed": us.get("fisher_auc_changed"),
        "fisher_auc_changed_within_binades": us.get("fisher_auc_changed_within_binades"),
        "fisher_auc_changed_by_binade": us.get("fisher_auc_changed_by_binade"),
        "fisher_auc_gradient": gsq.get("auc"),
        "fisher_precision_gradient": gsq.get("precision_at_k"),
        "fisher_spearman_gradient": gsq.get("spearman"),
        "fisher_auc_abs_delta": dlt.get("auc"),
        "reward_before": summary.get("accuracy_before"),
        "reward_after": summary.get("accuracy_after"),
        "train_reward_first": summary.get("reward_first"),
        "train_reward_last": summary.get("reward_last"),
        "seconds": summary.get("seconds"),
    }
    return {k: (_num(v) if isinstance(v, float) else v) for k, v in row.items()}


def markdown_table(points: list[dict[str, Any]]) -> str:
    """The sweep as a markdown table (fractions with 3 decimals, '-' where undefined; pipes in
    headers escaped)."""
    cols = [("precision", "precision"), ("optimizer", "optimizer"), ("lr", "lr"),
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


def run(spec: SweepSpec, progress: Any = null_progress) -> JobResult:
    from compute.models import load_model, resolve_device
    from compute.run_mask import load_scores
    from compute.run_train import independent_fisher, train_job
    from compute.tasks import get_task

    t0 = time.perf_counter()
    pts = grid(spec)
    n = len(pts)
    summary: dict[str, Any] = {"model": spec.model, "task": spec.task, "algo": spec.algo,
                               "grid": {"lrs": list(spec.lrs), "optimizers": list(spec.optimizers),
                                        "precision": list(spec.precision)}}
    result = JobResult(kind="sweep", summary=summary)
    if spec.fisher:
        fisher = load_scores(spec.fisher, "fisher")
        info: dict[str, Any] = {"source": "given", "file": spec.fisher}
    else:
        progress(0.0, "initial Fisher from independent samples")
        model, tok = load_model(spec.model, device=resolve_device(spec.device), dtype="float32")
        # the Fisher at the bf16-rounded base when every point starts there (bf16-mixed / bf16)
        if "fp32" not in spec.precision:
            from compute.train import prepare_precision

            prepare_precision(model, "bf16-mixed")
            rounded = True
        else:
            rounded = False
        probe = point_spec(spec, spec.precision[0], spec.optimizers[0], spec.lrs[0])
        fisher, info = independent_fisher(model, tok, get_task(spec.task), probe,
                                          lambda f, m="": progress(0.05 * f, m))
        info["base_rounded_to_bf16"] = rounded
        del model
        result.tensors["fisher"] = fisher
    summary["initial_fisher"] = info
    points: list[dict[str, Any]] = []
    for i, (prec, opt, lr) in enumerate(pts):
        lo, hi = 0.05 + 0.95 * i / n, 0.05 + 0.95 * (i + 1) / n
        label = f"point {i + 1}/{n}: {opt} lr {lr:g} {prec}"
        progress(lo, label)

        def sub(f: float, m: str = "", lo: float = lo, hi: float = hi, label: str = label) -> None:
            progress(lo + (hi - lo) * min(max(f, 0.0), 1.0), f"{label}: {m}" if m else label)

        res = train_job(point_spec(spec, prec, opt, lr), sub, fisher=fisher, fisher_info=info)
        folder = res.files.get("model")
        if folder:
            shutil.rmtree(Path(folder).parent, ignore_errors=True)
        row = point_row(prec, opt, lr, res.summary)
        points.append(row)
        for key in ("unchanged_bf16", "unchanged_exact", "fisher_auc_changed", "fisher_auc_gradient"):
            if row.get(key) is not None:
                result.series.append(SeriesPoint(f"sweep/{key}/{opt} {prec}", lr, row[key]))
        progress(hi, f"{label}: unchanged (bf16) {row['unchanged_bf16']:.3f}")
    summary["points"] = points
    summary["markdown"] = markdown_table(points)
    summary["seconds"] = round(time.perf_counter() - t0, 1)
    summary["definitions"] = {
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
    }
    result.heatmaps += _heatmaps(spec, points)
    progress(1.0, f"{n} points in {summary['seconds']:.0f} s")
    return result
