"""Job `mask`: build a parameter mask from a Fisher (or weights, gradient, random) at a density.

Also home of the layer x module heatmap helper the diff job reuses. References arrive resolved
(`refs`, see compute/jobs/runners.py) and are read through compute.jobs.artifact_files.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

import torch

from compute.contract.jobresult import Heatmap, JobResult, LayerStat, null_progress
from compute.contract.kinds import Ref, Refs
from compute.jobs.artifact_files import load_scores, resolved_refs
from compute.jobs.mask import MaskSpec
from compute.lm.cells import ratio_heatmap
from compute.lm.naming import layer_index, module_type
from compute.sparsity.masks import density_by, select_mask

# ---------------------------------------------------------------------------------------------
# Heatmap helper (also used by run_diff)
# ---------------------------------------------------------------------------------------------


def layer_module_heatmap(
    name: str, counts: Mapping[str, tuple[float, float]], meta: dict[str, Any] | None = None
) -> Heatmap:
    """Ratio sum(num) / sum(den) per (layer, module) cell from per-parameter (num, den) pairs."""
    return ratio_heatmap(name, counts, meta)


# ---------------------------------------------------------------------------------------------
# Gradient scores
# ---------------------------------------------------------------------------------------------


def sft_gradient(model_ref: Ref | str, task: str, prompts: int, seed: int, device: str = "auto"
                 ) -> dict[str, torch.Tensor]:
    """|d/dθ mean_n NLL(gold answer_n | prompt_n)| over `prompts` train prompts of `task`."""
    from compute.lm.causal_lm import load_model
    from compute.lm.sampling import build_rollout, token_logprobs
    from compute.lm.verifiable_tasks import get_task

    model, tok = load_model(model_ref, device=device, dtype="float32")
    examples = get_task(task).examples(prompts, seed=seed, split="train")
    dev = next(model.parameters()).device
    roll = build_rollout(tok, [e.prompt for e in examples], [e.answer for e in examples], device=dev)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    lp = token_logprobs(model, roll.input_ids, roll.attention_mask)  # (N, L)
    loss = -(lp * roll.completion_mask.to(lp.dtype)).sum() / lp.shape[0]
    loss.backward()
    out = {n: (p.grad.detach().abs().float().cpu() if p.grad is not None else torch.zeros_like(p, device="cpu"))
           for n, p in params.items()}
    model.zero_grad(set_to_none=True)
    return out


# ---------------------------------------------------------------------------------------------
# The job
# ---------------------------------------------------------------------------------------------


def _weights(model_ref: Ref | str) -> dict[str, torch.Tensor]:
    from compute.sparsity.diff import open_checkpoint

    ck = open_checkpoint(model_ref, "model")
    out = {}
    for n in ck.names():
        t = ck.get(n)
        if t.is_floating_point():
            out[n] = t
    return out


def build_mask(spec: MaskSpec, progress: Any = null_progress, refs: Refs | None = None
               ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The mask of a MaskSpec and a dict describing where its scores came from."""
    sel = spec.select
    refs = resolved_refs(spec, refs)
    fisher_ref, model, gradient = refs.get("fisher"), refs.get("model"), refs.get("gradient")
    fisher = load_scores(fisher_ref, "fisher") if fisher_ref is not None else None
    info: dict[str, Any] = {"fisher": spec.fisher, "model": spec.model}
    scores: dict[str, torch.Tensor] | None = None
    params: dict[str, torch.Tensor] | None = None
    if sel.startswith("fisher"):
        if fisher is None:
            raise ValueError(f"fisher: selector {sel!r} needs a Fisher (fisher.safetensors path or job:<id>)")
        scores = fisher
        info["scores"] = "fisher"
    elif sel.startswith("magnitude"):
        if model is None:
            raise ValueError(f"model: selector {sel!r} needs the model (its weights are ranked)")
        progress(0.1, "reading weights")
        params = _weights(model)
        if fisher is not None:
            params = _restrict(params, fisher)
        info["scores"] = "|weight|"
    elif sel == "gradient":
        if gradient is not None:
            scores = load_scores(gradient, "gradient")
            info["scores"] = f"|gradient| from {spec.gradient}"
        elif model is not None:
            progress(0.1, "computing the gradient")
            t0 = time.perf_counter()
            scores = sft_gradient(model, spec.task, spec.prompts, spec.seed, spec.device)
            info["gradient_seconds"] = time.perf_counter() - t0  # mask.timing's "gradient" part
            info["scores"] = (f"|gradient| of the mean gold-answer NLL over {spec.prompts} "
                              f"train prompts of {spec.task!r} (seed {spec.seed})")
        else:
            raise ValueError("gradient: selector 'gradient' needs --gradient FILE or --model")
        if fisher is not None:
            scores = _restrict(scores, fisher)
    else:  # random
        if fisher is not None:
            scores = fisher
        elif model is not None:
            params = _weights(model)
        else:
            raise ValueError("model: selector 'random' needs --model or --fisher (for tensor shapes)")
        info["scores"] = f"uniform random per tensor, seed {spec.seed}"
    if model is not None and fisher is not None and sel.startswith("fisher"):
        _restrict(_shapes_only(model), fisher)  # the Fisher must belong to this model
    what = f"selecting {sel} at density {spec.density}"
    progress(0.5, what)
    mask = select_mask(sel, spec.density, scores=scores, params=params, seed=spec.seed,
                       progress=lambda f: progress(0.5 + 0.3 * f, what))
    return mask, {**info, "fisher_tensors": fisher}


def _shapes_only(model_ref: Ref | str) -> dict[str, torch.Tensor]:
    from compute.sparsity.diff import open_checkpoint

    ck = open_checkpoint(model_ref, "model")
    return {n: torch.empty(ck.shape(n), device="meta") for n in ck.names()}


def _restrict(d: Mapping[str, torch.Tensor], ref: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """d's tensors for ref's names (ValueError naming the first missing or mis-shaped one, by
    compute.contract.shapes.mismatch)."""
    from compute.contract.shapes import mismatch, shapes_of

    why = mismatch(shapes_of(ref), shapes_of(d), "the Fisher", "the model")
    if why:
        raise ValueError(f"model: {why}")
    return {n: d[n] for n in ref}


def run(spec: MaskSpec, progress: Any = null_progress, refs: Refs | None = None) -> JobResult:
    t0 = time.perf_counter()
    mask, info = build_mask(spec, progress, refs)
    gradient_s = float(info.pop("gradient_seconds", 0.0))
    fisher = info.pop("fisher_tensors")
    progress(0.8, "statistics")
    kept = {n: int(m.sum()) for n, m in mask.items()}
    total = sum(m.numel() for m in mask.values())
    n_kept = sum(kept.values())
    summary: dict[str, Any] = {
        "select": spec.select,
        "density_requested": spec.density,
        "density": n_kept / total,
        "kept": n_kept,
        "total": total,
        "tensors": len(mask),
        "seed": spec.seed,
        "scores": info["scores"],
        "fisher": spec.fisher,
        "model": spec.model,
        "exact_count_rule": "round_half_up(density * total); per-tensor selectors: largest remainder",
        "tie_rule": "sorted parameter name, then flat index ascending",
        "by_module": {k: v["density"] for k, v in density_by(mask, "module").items()},
        "by_layer": {k: v["density"] for k, v in density_by(mask, "layer").items()},
    }
    fisher_mass: dict[str, float] = {}
    if fisher is not None and set(fisher) >= set(mask):
        tot = sum(float(fisher[n].double().sum()) for n in mask)
        fisher_mass = {n: float(fisher[n].double()[mask[n]].sum()) for n in mask}
        summary["fisher_mass_kept"] = sum(fisher_mass.values()) / tot if tot > 0 else float("nan")
        if spec.select != "fisher":
            from compute.sparsity.overlap import mask_overlap

            ref = select_mask("fisher", spec.density, scores={n: fisher[n] for n in mask})
            ov = mask_overlap(mask, ref)["all"]
            summary["overlap_with_fisher_topk"] = {
                "jaccard": ov["jaccard"], "jaccard_random": ov["jaccard_baseline"],
                "jaccard_lift": ov["jaccard_lift"], "overlap_frac": ov["overlap_frac_a"],
            }
    rows = []
    for n, m in mask.items():
        vals = {"density": kept[n] / m.numel(), "kept": float(kept[n]), "numel": float(m.numel())}
        if fisher_mass:
            vals["fisher_mass_kept"] = fisher_mass[n]
        rows.append(LayerStat(param=n, module=module_type(n), layer=layer_index(n), values=vals))
    heat = layer_module_heatmap(
        "mask_density", {n: (float(kept[n]), float(m.numel())) for n, m in mask.items()},
        {"units": "kept fraction", "zmin": 0.0, "zmax": 1.0, "title": f"{spec.select} mask density"},
    )
    # issue 18: the precision of the stored mask, and the verdict of the Fisher it was built on
    # (also in the mask file, so a train job on this mask shows it)
    summary["stored_dtype"] = "bool"
    summary["compute_dtype"] = "float32"  # scores ranked in float32
    metadata: dict[str, str] = {}
    fisher_ref = resolved_refs(spec, refs).get("fisher")
    if fisher_ref is not None:
        from compute.jobs.artifact_files import fisher_provenance

        summary["fisher_reliability"] = fisher_provenance(fisher_ref)
        metadata["fisher_reliability"] = json.dumps(summary["fisher_reliability"], default=str)
    # where the time went, by mask.timing's parts
    summary["seconds_parts"] = {"select": round(time.perf_counter() - t0 - gradient_s, 3)}
    if gradient_s:
        summary["seconds_parts"]["gradient"] = round(gradient_s, 3)
    progress(1.0, "done")
    return JobResult(kind="mask", summary=summary, layer_stats=rows, heatmaps=[heat],
                     tensors={"mask": mask}, metadata={"mask": metadata} if metadata else {})
