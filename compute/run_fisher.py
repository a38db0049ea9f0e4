"""Job `fisher`: sample on-policy completions for task prompts, estimate the diagonal Fisher,
and report where its mass sits (per tensor, layer x module), its concentration, its split-half
stability, and (optionally) its error against the exact output-layer Fisher.

Sharding: the prompt range is split into `spec.shards` contiguous parts. `run_shard` computes the
un-normalised sums of one part (its samples depend only on its prompt indices and the seed), and
`finish` adds them up, so `run(spec)` equals `finish(spec, [run_shard(spec, i) ...])` whether the
shards ran on one worker or many.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from compute import analysis
from compute.contract.jobresult import JobResult, Progress, null_progress
from compute.contract.kinds import Refs
from compute.fisher import (
    ExactOutputUnsupported,
    FisherConfig,
    estimate_fisher,
    exact_output_fisher,
    relative_error,
)
from compute.jobs.fisher import FisherSpec


def shard_range(spec: FisherSpec, shard_index: int) -> tuple[int, int]:
    """[lo, hi) prompt offsets (relative to spec.prompt_start) of one shard."""
    if not 0 <= shard_index < spec.shards:
        raise ValueError(f"shard_index: got {shard_index}; accepted range: 0..{spec.shards - 1}")
    lo = round(shard_index * spec.prompts / spec.shards)
    hi = round((shard_index + 1) * spec.prompts / spec.shards)
    return lo, hi


def _load(spec: FisherSpec, refs: Refs | None) -> tuple[Any, Any]:
    from compute.artifacts import ref_of
    from compute.models import load_model

    model = ref_of(refs, "model", spec.model)
    assert model is not None  # the spec requires a model
    return load_model(model, device=spec.device, dtype=spec.dtype)


def _config(spec: FisherSpec, n_prompts: int, start: int) -> FisherConfig:
    return FisherConfig(
        estimator=spec.estimator, prompts=n_prompts, samples=spec.samples,
        max_new_tokens=spec.max_new_tokens, temperature=spec.temperature, top_k=spec.top_k,
        top_p=spec.top_p, seed=spec.seed, prompt_start=start,
        memory_budget_mb=spec.memory_budget_mb, device=spec.device, dtype=spec.dtype,
    )


def _shard(spec: FisherSpec, shard_index: int, progress: Progress, loaded: tuple | None,
           refs: Refs | None = None) -> dict:
    from compute.tasks import get_task

    t0 = time.perf_counter()
    lo, hi = shard_range(spec, shard_index)
    empty = {"shard": shard_index, "prompt_range": [spec.prompt_start + lo, spec.prompt_start + hi],
             "sums": {}, "denoms": [0.0, 0.0], "n_rows": 0, "n_tokens": 0, "exact": None,
             "seconds": 0.0}
    if hi <= lo:
        return empty
    task = get_task(spec.task)
    model, tok = loaded or _load(spec, refs)
    examples = task.examples(hi - lo, seed=spec.seed, split="train", start=spec.prompt_start + lo)
    cfg = _config(spec, hi - lo, spec.prompt_start + lo)
    res = estimate_fisher(model, tok, examples, cfg, progress=progress)
    if res.halves is not None:
        sums, denoms = res.halves, list(res.half_denoms or (0.0, 0.0))
    else:  # batch estimator: a plain sum over minibatches, no normalisation
        sums, denoms = {n: f.unsqueeze(0) for n, f in res.fisher.items()}, None
    exact = None
    head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    tied = head is not None and emb is not None and head.weight is emb.weight
    # with tied embeddings the MC Fisher of the shared matrix includes the input use, so it is
    # not comparable with the closed form of the output use alone: skip the check
    skipped = None
    if spec.exact_output and tied:
        skipped = ("tied embeddings: the Monte-Carlo Fisher of the shared matrix includes its "
                   "input use; the closed form covers the output use only")
    if spec.exact_output and spec.estimator != "batch" and res.rollout is not None and not tied:
        roll = res.rollout
        norm = "token" if spec.estimator == "token" else "sequence"
        try:
            ex = exact_output_fisher(model, roll.input_ids, roll.attention_mask,
                                     roll.completion_mask, normalize=norm)
            count = res.n_tokens if norm == "token" else res.n_rows
            exact = {"sums": {n: t * count for n, t in ex.items()}, "count": float(count)}
        except ExactOutputUnsupported as exc:  # logit scaling / soft-capping: not head(h)
            skipped = str(exc)
    out = dict(empty)
    out.update(sums=sums, denoms=denoms, n_rows=res.n_rows, n_tokens=res.n_tokens, exact=exact,
               exact_skipped=skipped, seconds=round(time.perf_counter() - t0, 3))
    return out


def run_shard(spec: FisherSpec, shard_index: int, progress: Progress = null_progress,
              refs: Refs | None = None) -> dict:
    """Un-normalised Fisher sums of one shard's prompts (tensors + JSON-able numbers).

    {"sums": {name: (2 halves | 1, *shape) float32}, "denoms": [d_even, d_odd] | None (batch),
     "n_rows", "n_tokens", "exact": {"sums": {name: tensor}, "count"} | None, ...}"""
    return _shard(spec, shard_index, progress, None, refs)


def _add(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: a[n] + b[n] if n in a else b[n] for n in {**a, **b}}


def finish(spec: FisherSpec, shard_outputs: list[dict], progress: Progress = null_progress,
           extra: dict | None = None) -> JobResult:
    """Combine shard sums into the Fisher and its statistics."""
    progress(0.97, "statistics")
    outs = sorted(shard_outputs, key=lambda o: o["shard"])
    sums: dict[str, torch.Tensor] = {}
    exact: dict[str, torch.Tensor] = {}
    exact_count = 0.0
    denoms = [0.0, 0.0]
    for o in outs:
        sums = _add(sums, o["sums"])
        if o["denoms"] is not None:
            denoms = [denoms[0] + o["denoms"][0], denoms[1] + o["denoms"][1]]
        if o.get("exact"):
            exact = _add(exact, o["exact"]["sums"])
            exact_count += o["exact"]["count"]
    if not sums:
        raise ValueError("prompts: no prompts were processed")
    # keep the model's parameter order (the first non-empty shard's dict order)
    order = next(list(o["sums"]) for o in outs if o["sums"])
    batch = spec.estimator == "batch"
    total = 1.0 if batch else denoms[0] + denoms[1]
    if total <= 0:
        raise ValueError("max_new_tokens: no completion tokens were sampled")
    fisher = {n: (sums[n].double().sum(0) / total).float() for n in order}
    summary: dict[str, Any] = {
        "estimator": spec.estimator, "model": spec.model, "task": spec.task,
        "n_prompts": spec.prompts, "n_rows": sum(o["n_rows"] for o in outs),
        "n_tokens": sum(o["n_tokens"] for o in outs), "shards": len(outs),
        "seconds": round(sum(o["seconds"] for o in outs), 3), "settings": spec.model_dump(),
    }
    summary["n_samples"] = summary["n_tokens"] if spec.estimator == "token" else summary["n_rows"]
    summary.update(analysis.summary(fisher))
    if not batch and denoms[0] > 0 and denoms[1] > 0:
        halves = [{n: sums[n][k].double() / denoms[k] for n in order} for k in (0, 1)]
        summary["split_half_jaccard"] = analysis.topk_jaccard(halves[0], halves[1],
                                                              spec.topk_percent)
        summary["split_half_topk_percent"] = spec.topk_percent
    else:
        summary["split_half_jaccard"] = None
    if exact and exact_count > 0:
        rows = {}
        for n, s in exact.items():
            ref = s / exact_count
            rows[n] = {"relative_l1_error": relative_error(fisher[n], ref),
                       "mc_mass": float(fisher[n].double().sum()),
                       "exact_mass": float(ref.double().sum())}
        summary["exact_output"] = rows
    skipped = next((o["exact_skipped"] for o in outs if o.get("exact_skipped")), None)
    if skipped:
        summary["exact_output_skipped"] = skipped
    summary.update(extra or {})
    series = analysis.to_series(fisher)
    result = JobResult(
        kind="fisher", summary=summary, layer_stats=analysis.to_layer_stats(fisher),
        heatmaps=analysis.to_heatmaps(fisher), series=series, tensors={"fisher": fisher},
    )
    progress(1.0, "done")
    return result


def run(spec: FisherSpec, progress: Progress = null_progress, refs: Refs | None = None) -> JobResult:
    """Every shard in this process (model loaded once), then `finish`."""
    progress(0.0, "loading model")
    loaded = _load(spec, refs)
    from compute.models import model_info

    info = model_info(loaded[0])
    outs = []
    for i in range(spec.shards):
        def sub(f: float, m: str = "", i: int = i) -> None:
            progress(0.02 + 0.95 * (i + f) / spec.shards, m)

        outs.append(_shard(spec, i, sub, loaded))
    return finish(spec, outs, progress, extra={"model_info": info})


# -- child units (the protocol of compute/runners.py): one child per prompt shard --------------
def children(spec: FisherSpec) -> int:
    return spec.shards


def run_child(spec: FisherSpec, index: int, progress: Progress = null_progress,
              refs: Refs | None = None) -> dict:
    return run_shard(spec, index, progress, refs)


def combine(spec: FisherSpec, outputs: list[dict], progress: Progress = null_progress,
            refs: Refs | None = None) -> JobResult:
    return finish(spec, outputs, progress)
