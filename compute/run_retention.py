"""Job `retention`: the fixed-mask retention grid of compute.retention as a JobResult."""

from __future__ import annotations

import math
from typing import Any

from compute.results import Heatmap, JobResult, SeriesPoint, null_progress
from compute.specs import DEFAULT_TEACHERS, RetentionSpec


def run(spec: RetentionSpec, progress: Any = null_progress) -> JobResult:
    import torch

    from compute.distill import check_same_tokenizer
    from compute.fisher import FisherConfig
    from compute.models import load_model, resolve_device
    from compute.retention import markdown_table, run_retention
    from compute.run_train import config_from_spec
    from compute.tasks import get_task

    teacher_ref = spec.teacher
    if spec.algo == "opd" and not teacher_ref:
        teacher_ref = DEFAULT_TEACHERS.get(spec.model)
        if not teacher_ref:
            raise ValueError("teacher: algo 'opd' needs a teacher model for this --model")
    task = get_task(spec.task)
    device = resolve_device(spec.device)
    torch.manual_seed(0)
    progress(0.0, f"loading {spec.model}")
    model, tok = load_model(spec.model, device=device, dtype=spec.dtype)
    teacher = None
    if spec.algo == "opd":
        teacher, ttok = load_model(teacher_ref, device=device, dtype=spec.dtype)
        check_same_tokenizer(tok, ttok)
    config = config_from_spec(spec, seed=0, steps=spec.steps, kl_coef=spec.kl_coef)
    fcfg = FisherConfig(prompts=spec.fisher_prompts, samples=spec.fisher_samples,
                        max_new_tokens=spec.max_new_tokens, seed=0, device=spec.device)
    densities = sorted(set(float(d) for d in spec.densities))
    selectors = list(dict.fromkeys(spec.selectors))
    table = run_retention(model, tok, task, config, selectors, densities, spec.seeds, fcfg,
                          teacher=teacher, progress=progress)
    table["markdown"] = markdown_table(table)
    curves = table.pop("curves")
    summary: dict[str, Any] = {
        "model": spec.model, "task": spec.task, "algo": spec.algo, "teacher": teacher_ref,
        "settings": {**config.__dict__, "seeds": spec.seeds, "selectors": selectors,
                     "densities": densities, "fisher": fcfg.__dict__},
        "eval": {"split": "test", "prompts": spec.eval_prompts, "decoding": "greedy",
                 "reward": "task reward averaged over held-out prompts (= accuracy)"},
        **table,
    }
    series = []
    for r in table["rows"]:
        series.append(SeriesPoint(f"retention/{r['selector']}", r["density"], r["retention_mean"]))
        series.append(SeriesPoint(f"heldout/{r['selector']}", r["density"], r["reward_mean"]))
    for label, runs in curves.items():  # per-step sample reward, averaged over seeds
        steps = max(len(c) for c in runs)
        for i in range(steps):
            vals = [c[i]["reward"] for c in runs if i < len(c) and "reward" in c[i]]
            if vals:
                series.append(SeriesPoint(f"train_reward/{label}", i + 1, sum(vals) / len(vals)))
    z = [[next((r["retention_mean"] for r in table["rows"]
                if r["selector"] == s and r["density"] == d), None) for d in densities]
         for s in selectors]
    z = [[None if v is None or math.isnan(v) else v for v in row] for row in z]
    heat = Heatmap("retention", [f"{d:g}" for d in densities], selectors, z,
                   meta={"x": "density", "y": "selector", "value": "retention (mean over seeds)"})
    return JobResult(kind="retention", summary=summary, heatmaps=[heat], series=series)
