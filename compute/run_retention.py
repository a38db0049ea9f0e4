"""Job `retention`: the fixed-mask retention grid of compute.retention as a JobResult."""

from __future__ import annotations

import math
from typing import Any

from compute.results import Heatmap, JobResult, SeriesPoint, null_progress
from compute.specs import DEFAULT_TEACHERS, RetentionSpec

SMALL_MODEL_PARAMS = 20_000_000  # below this, CPU runs use one torch thread


def run(spec: RetentionSpec, progress: Any = null_progress) -> JobResult:
    import torch

    from compute.distill import check_same_tokenizer
    from compute.fisher import FisherConfig
    from compute.models import load_model, resolve_device
    from compute.retention import BootstrapConfig, RetentionConfig, markdown_table, run_retention
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
    rcfg = RetentionConfig(
        train=config, fisher=fcfg,
        selectors=tuple(dict.fromkeys(spec.selectors)),
        densities=tuple(sorted(set(float(d) for d in spec.densities))),
        seeds=spec.seeds, eval_prompts=spec.eval_prompts,
        eval_max_new_tokens=config.eval_max_new_tokens,
        bootstrap=BootstrapConfig(replicates=spec.bootstrap, confidence=spec.confidence),
    )
    threads = torch.get_num_threads()
    # A model this small runs several times faster on one CPU thread (measured on arith-base:
    # 100 GRPO steps in ~10 s on 1 thread, ~40 s on 2), and results are the same.
    small = device.type == "cpu" and sum(p.numel() for p in model.parameters()) < SMALL_MODEL_PARAMS
    if small:
        torch.set_num_threads(1)
    try:
        table = run_retention(model, tok, task, rcfg, teacher=teacher, progress=progress)
    finally:
        torch.set_num_threads(threads)
    table["markdown"] = markdown_table(table)
    curves = table.pop("curves")
    per_prompt = table.pop("per_prompt_rewards")  # (S, n) lists: an artifact, not a summary field
    summary: dict[str, Any] = {
        "model": spec.model, "task": spec.task, "algo": spec.algo, "teacher": teacher_ref,
        "settings": {**config.__dict__, "seeds": spec.seeds, "selectors": list(rcfg.selectors),
                     "densities": list(rcfg.densities), "fisher": fcfg.__dict__,
                     "torch_threads": 1 if small else threads},
        "eval": {"split": "test", "prompts": spec.eval_prompts, "eval_se_target": spec.eval_se,
                 "decoding": "greedy", "max_new_tokens": rcfg.eval_max_new_tokens,
                 "reward": "task reward of each held-out prompt (accuracy), the same prompts for every model"},
        **table,
    }
    series = []
    for r in table["rows"]:
        if r["retention"] is not None:
            series.append(SeriesPoint(f"retention/{r['selector']}", r["density"], r["retention"]))
        series.append(SeriesPoint(f"heldout/{r['selector']}", r["density"], r["reward_mean"]))
    for label, runs in curves.items():  # per-step sample reward, averaged over seeds
        steps = max(len(c) for c in runs)
        for i in range(steps):
            vals = [c[i]["reward"] for c in runs if i < len(c) and "reward" in c[i]]
            if vals:
                series.append(SeriesPoint(f"train_reward/{label}", i + 1, sum(vals) / len(vals)))
    z = [[next((r["retention"] for r in table["rows"]
                if r["selector"] == s and r["density"] == d), None) for d in rcfg.densities]
         for s in rcfg.selectors]
    z = [[None if v is None or math.isnan(v) else v for v in row] for row in z]
    value = ("retention (ratio of means over seeds and prompts)" if table["retention_valid"]
             else "no retention: full training did not beat the base beyond its error")
    heat = Heatmap("retention", [f"{d:g}" for d in rcfg.densities], list(rcfg.selectors), z,
                   meta={"x": "density", "y": "selector", "value": value})
    rewards = {k: torch.tensor(v, dtype=torch.float32) for k, v in per_prompt.items()}
    return JobResult(kind="retention", summary=summary, heatmaps=[heat], series=series,
                     tensors={"rewards": rewards})
