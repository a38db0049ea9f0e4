"""Job `train`: one post-training run (GRPO, OPD or SFT), full or masked, on a model.

The trained model (HF format, with its tokenizer and metrics.json) is written to a fresh temp
folder whose path is JobResult.files["model"]; the worker (or the CLI) moves it.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from compute.results import JobResult, SeriesPoint, null_progress
from compute.specs import TrainSpec

FISHER_SELECTORS = ("fisher", "fisher-tensor", "fisher-bottom")


def config_from_spec(spec: Any, seed: int | None = None, **over: Any) -> Any:
    """TrainConfig from a TrainSpec (or any object with the same field names)."""
    from compute.train import TrainConfig

    kw = dict(
        algo=spec.algo, optimizer=spec.optimizer, lr=spec.lr, weight_decay=spec.weight_decay,
        steps=spec.steps, batch=spec.batch, group=spec.group, max_new_tokens=spec.max_new_tokens,
        eval_prompts=spec.eval_prompts, seed=spec.seed if seed is None else seed,
    )
    for name in ("momentum", "grad_clip", "temperature", "distill_estimator", "kl_coef", "clip_eps",
                 "sft_source"):
        if hasattr(spec, name):
            kw[name] = getattr(spec, name)
    kw.update(over)
    return TrainConfig(**kw)


def build_mask_in_memory(
    model: torch.nn.Module,
    tokenizer: Any,
    task: Any,
    selector: str,
    density: float,
    seed: int,
    fisher: Mapping[str, torch.Tensor] | None = None,
    fisher_config: Any = None,
    gradient_config: Any = None,
    teacher: torch.nn.Module | None = None,
    progress: Any = null_progress,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A mask of `model` by selector at density; estimates the Fisher when one is needed and not
    given (sequence estimator, fisher_config), or the |gradient| of the training objective."""
    from compute.masks import mask_density, select_mask

    info: dict[str, Any] = {"select": selector, "density": density, "seed": seed}
    if selector in FISHER_SELECTORS:
        if fisher is None:
            from compute.fisher import estimate_fisher

            progress(0.0, "estimating the Fisher for the mask")
            fisher = estimate_fisher(model, tokenizer, task, fisher_config).fisher
            info["fisher"] = {"prompts": fisher_config.prompts, "samples": fisher_config.samples,
                              "estimator": fisher_config.estimator}
        mask = select_mask(selector, density, scores=dict(fisher), params=model, seed=seed)
    elif selector == "gradient":
        from compute.train import objective_gradient

        progress(0.0, "gradient of the training objective")
        grads = objective_gradient(model, tokenizer, task, gradient_config, teacher)
        info["scores"] = "|gradient| of the training objective on the first batch"
        mask = select_mask(selector, density, scores=grads, params=model, seed=seed)
    else:  # random, magnitude, magnitude-bottom
        mask = select_mask(selector, density, params=model, seed=seed)
    dev = next(model.parameters()).device
    mask = {n: m.to(dev) for n, m in mask.items()}
    info["actual_density"] = mask_density(mask)
    return mask, info


def update_sparsity(
    base: Mapping[str, torch.Tensor], tuned: torch.nn.Module, fisher: Mapping[str, torch.Tensor] | None = None
) -> dict[str, Any]:
    """Global update-sparsity numbers of a run (compute.diff) and, with a Fisher, its precision@k
    against the changed / top-|delta| coordinates."""
    from compute.diff import diff_checkpoints

    tuned_sd = {n: p.detach().cpu() for n, p in tuned.named_parameters()}
    d = diff_checkpoints(dict(base), tuned_sd, fisher=fisher, svd_max_numel=0)
    glob = next(iter(d.groups["global"].values()))
    out = {k: v for k, v in glob.items() if k.startswith(("unchanged_", "changed_"))}
    if d.fisher is not None:
        g = d.fisher.get("global", {})
        allm = next(iter(g.values())) if g else {}
        out["fisher_precision_at_top1pct_delta"] = allm.get("precision_at_k")
        out["fisher_auc_top1pct_delta"] = allm.get("auc")
        out["fisher_precision_at_changed"] = d.fisher.get("changed", {}).get("precision_at_n_changed")
        out["fisher_auc_changed"] = d.fisher.get("changed", {}).get("auc")
    return out


def _load(ref: str, spec: Any) -> tuple[Any, Any]:
    from compute.models import load_model, resolve_device

    return load_model(ref, device=resolve_device(spec.device), dtype=getattr(spec, "dtype", "auto"))


def run(spec: TrainSpec, progress: Any = null_progress) -> JobResult:
    from compute.bound import first_step_bound, summarize
    from compute.distill import check_same_tokenizer
    from compute.fisher import FisherConfig
    from compute.masks import load_mask
    from compute.run_mask import resolve_artifact
    from compute.tasks import get_task
    from compute.train import save_output, train

    task = get_task(spec.task)
    if spec.mask and spec.mask_select:
        raise ValueError("mask: give either mask (a file) or mask_select + mask_density, not both")
    if spec.mask_select and spec.mask_density is None:
        raise ValueError("mask_density: needed with mask_select (e.g. 0.05)")
    if spec.algo == "opd" and not spec.teacher:
        raise ValueError("teacher: algo 'opd' needs a teacher model (e.g. arith-teacher)")
    torch.manual_seed(spec.seed)
    progress(0.0, f"loading {spec.model}")
    model, tok = _load(spec.model, spec)
    teacher = None
    if spec.algo == "opd":
        teacher, ttok = _load(spec.teacher, spec)
        check_same_tokenizer(tok, ttok)
    config = config_from_spec(spec)
    summary: dict[str, Any] = {"model": spec.model, "task": spec.task, "algo": spec.algo}
    mask = None
    result = JobResult(kind="train", summary=summary)
    if spec.mask:
        mask = load_mask(resolve_artifact(spec.mask, "mask"), model=model,
                         device=next(model.parameters()).device)
        summary["mask"] = {"file": spec.mask}
    elif spec.mask_select:
        fcfg = FisherConfig(prompts=spec.fisher_prompts, samples=spec.fisher_samples,
                            max_new_tokens=spec.max_new_tokens, seed=spec.seed, device=spec.device)
        mask, info = build_mask_in_memory(
            model, tok, task, spec.mask_select, float(spec.mask_density or 0), spec.seed,
            fisher_config=fcfg, gradient_config=config, teacher=teacher,
            progress=lambda f, m="": progress(0.1 * f, m),
        )
        summary["mask"] = info
        result.tensors["mask"] = {n: m.cpu() for n, m in mask.items()}
    base = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    if spec.algo == "grpo" and spec.bound:
        progress(0.1, "bound check on the first GRPO batch")
        b = first_step_bound(model, tok, task, prompts=spec.batch, group=spec.group,
                             max_new_tokens=spec.max_new_tokens, seed=spec.seed,
                             temperature=spec.temperature)
        bsum, bseries, bheat = summarize(b)
        summary["bound"] = {**bsum, "mean_reward": b.summary.get("bound_mean_reward")}
        result.series += bseries
        result.heatmaps += bheat
        del b
    res = train(model, tok, task, config, mask=mask, teacher=teacher,
                progress=lambda f, m="": progress(0.15 + 0.75 * f, m))
    progress(0.92, "update sparsity")
    summary.update(
        accuracy_before=res.accuracy_before, accuracy_after=res.accuracy_after,
        accuracy_gain=res.accuracy_after - res.accuracy_before, seconds=round(res.seconds, 2),
        trainable_fraction=res.trainable_fraction, settings=res.settings,
        eval={"split": "test", "prompts": spec.eval_prompts, "decoding": "greedy"},
    )
    summary["update_sparsity"] = update_sparsity(base, model)
    for row in res.curve:
        for k in ("reward", "loss", "accuracy", "reverse_kl", "kl", "grad_norm"):
            if k in row and not math.isnan(row[k]):
                result.series.append(SeriesPoint(f"train/{k}", row["step"], row[k]))
    result.series.append(SeriesPoint("eval/accuracy", 0, res.accuracy_before))
    result.series.append(SeriesPoint("eval/accuracy", spec.steps, res.accuracy_after))
    out = Path(tempfile.mkdtemp(prefix="fisherlens-train-")) / "model"
    metrics = {"curve": res.curve, **summary, "spec": spec.model_dump(mode="json")}
    save_output(model, tok, out, metrics)
    result.files["model"] = str(out)
    progress(1.0, f"accuracy {res.accuracy_before:.3f} -> {res.accuracy_after:.3f}")
    return result
