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

from compute.contract.cost import length_record, merge_length_records
from compute.contract.jobresult import JobResult, Progress, null_progress
from compute.contract.kinds import Refs
from compute.fisher import (
    ExactOutputUnsupported,
    FisherConfig,
    estimate_fisher,
    exact_output_fisher,
    relative_error,
)
from compute.fisher import statistics as analysis
from compute.fisher.accumulate import HalfSums
from compute.jobs.fisher import FisherSpec
from compute.runtime.memory import mmap_threshold_fixed, release_freed_memory


def shard_range(spec: FisherSpec, shard_index: int) -> tuple[int, int]:
    """[lo, hi) prompt offsets (relative to spec.prompt_start) of one shard."""
    if not 0 <= shard_index < spec.shards:
        raise ValueError(f"shard_index: got {shard_index}; accepted range: 0..{spec.shards - 1}")
    lo = round(shard_index * spec.prompts / spec.shards)
    hi = round((shard_index + 1) * spec.prompts / spec.shards)
    return lo, hi


def _load(spec: FisherSpec, refs: Refs | None) -> tuple[Any, Any]:
    from compute.jobs.artifact_files import resolved_refs
    from compute.lm.causal_lm import load_model

    model = resolved_refs(spec, refs).get("model")
    assert model is not None  # the spec requires a model
    return load_model(model, device=spec.device, dtype=spec.dtype)


def _config(spec: FisherSpec, n_prompts: int, start: int) -> FisherConfig:
    return FisherConfig.of(spec, prompts=n_prompts, prompt_start=start)


PRECISION_CHECK_ROWS = 16  # rows of the first shard scored again in float32 (half-precision runs)


def precision_error(model: Any, roll: Any, estimator: str, memory_budget_mb: int | None = None,
                    rows: int = PRECISION_CHECK_ROWS, topk_percent: float = 1.0) -> dict[str, Any] | None:
    """compute.fisher.precision.precision_error (the model made float32 in place, restored)."""
    from compute.fisher.precision import precision_error as measure

    return measure(model, roll, estimator, memory_budget_mb, rows, topk_percent)


def precision_check_plan(model: Any, held_bytes: int, memory_budget_mb: int | None) -> tuple[str | None, int]:
    """(why the float32 check of a half-precision model is skipped or None, the temporaries budget
    in MiB it runs with).

    Issue 30, one rule with the Fisher itself: the check may use what the job's allowance (6
    bytes/param of sums + the temporaries budget, above the loaded weights) leaves on the model's
    device once the Fisher's own sums are held there (`held_bytes`: all of them on a CPU, none on a
    GPU, where they have gone to the host), and no more than the memory free there now: its sums
    and the widened weights (compute.fisher.precision.check_bytes) first, its temporaries get the
    rest. The Fisher is not affected either way (its sums are float32)."""
    from compute.contract.cost import FISHER_BYTES_PER_PARAM, PRECISION_CHECK_MIN_TEMPORARIES_MB
    from compute.fisher.precision import check_bytes
    from compute.lm.device import default_budget_mb, free_memory_bytes, model_device

    dev = model_device(model)
    n = sum(p.numel() for p in model.parameters())
    budget = int((memory_budget_mb if memory_budget_mb is not None else default_budget_mb(dev)) * 2**20)
    room = min(FISHER_BYTES_PER_PARAM * n + budget - held_bytes, free_memory_bytes(dev))
    need = check_bytes(model)
    temporaries = min(budget, room - need) // 2**20
    if temporaries >= PRECISION_CHECK_MIN_TEMPORARIES_MB:
        return None, int(temporaries)
    where = "the CPU" if dev.type == "cpu" else str(dev)
    return (f"not measured: scoring the first rows again in float32 needs {need / 2**30:.2f} GiB + "
            f"{PRECISION_CHECK_MIN_TEMPORARIES_MB} MiB of temporaries, more than the {max(room, 0) / 2**30:.2f} GiB "
            f"left on {where} within the job's allowance (6 bytes/param of sums + the {budget / 2**20:.0f} MiB "
            "temporaries budget, less the Fisher's sums held there) or free; the sums are float32 either way. "
            "A larger --memory-budget-mb, or a rerun of a few prompts in float32, measures it"), 0


def _shard(spec: FisherSpec, shard_index: int, progress: Progress, loaded: tuple | None,
           refs: Refs | None = None) -> dict:
    from compute.lm.verifiable_tasks import get_task

    t0 = time.perf_counter()
    lo, hi = shard_range(spec, shard_index)
    empty = {"shard": shard_index, "prompt_range": [spec.prompt_start + lo, spec.prompt_start + hi],
             "sums": {}, "denoms": [0.0, 0.0], "n_rows": 0, "n_tokens": 0, "exact": None,
             "seconds": 0.0}
    if hi <= lo:
        return empty
    task = get_task(spec.task)
    t_load = time.perf_counter()
    model, tok = loaded or _load(spec, refs)
    load_s = time.perf_counter() - t_load  # a shard run alone (a queued fan-out) loads its model
    examples = task.examples(hi - lo, seed=spec.seed, split="train", start=spec.prompt_start + lo)
    cfg = _config(spec, hi - lo, spec.prompt_start + lo)
    after = 0.9 if spec.exact_output or next(model.parameters()).dtype != torch.float32 else 1.0
    res = estimate_fisher(model, tok, examples, cfg,
                          progress=lambda f, m="": progress(after * f, m))  # then the checks
    release_freed_memory()  # the passes' row temporaries, before the checks allocate theirs
    diffs: dict[str, torch.Tensor] | None = None
    roundings = 0
    if res.halves is not None:  # the halves' total, and their difference (HalfSums)
        sums, diffs, roundings = res.halves.total, res.halves.diff, res.halves.roundings
        denoms = list(res.half_denoms or (0.0, 0.0))
    else:  # batch estimator: a plain sum over minibatches, no normalisation
        sums, denoms = dict(res.fisher), None
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
        progress(0.9, "exact output-layer Fisher (closed form, every row)")
        try:
            ex = exact_output_fisher(model, roll.input_ids, roll.attention_mask,
                                     roll.completion_mask, normalize=norm)
            count = res.n_tokens if norm == "token" else res.n_rows
            exact = {"sums": {n: t * count for n, t in ex.items()}, "count": float(count)}
        except ExactOutputUnsupported as exc:  # logit scaling / soft-capping: not head(h)
            skipped = str(exc)
    out = dict(empty)
    st = res.settings
    est_s, sample_s, check_s = (float(st.get(k) or 0.0) for k in ("total_seconds", "sample_seconds", "check_seconds"))
    # where the shard's time went (issue 30: time against the floor is profiled, not guessed)
    parts = {"load": load_s, "sampling": sample_s, "self-check": check_s,
             "per-sample passes": max(0.0, est_s - sample_s - check_s),
             "exact output check": max(0.0, time.perf_counter() - t0 - est_s - load_s)}
    if loaded:
        del parts["load"]  # loaded once by `run`, which reports it
    out["seconds_parts"] = parts
    t_shard = time.perf_counter() - t0
    out.update(sums=sums, diffs=diffs, diff_roundings=roundings, denoms=denoms, n_rows=res.n_rows,
               n_tokens=res.n_tokens, exact=exact, exact_skipped=skipped, seconds=round(t_shard, 3),
               compute_dtype=str(next(model.parameters()).dtype).replace("torch.", ""),
               memory_budget_mb=st.get("memory_budget_mb_used"))
    if res.rollout is not None and res.rollout.lengths is not None:  # sampled: how long the rows ran
        out["completion_lengths"] = length_record(res.rollout.lengths, spec.max_new_tokens)
    half = next(model.parameters()).dtype in (torch.bfloat16, torch.float16)
    if half and shard_index == 0 and res.rollout is not None and spec.estimator != "batch":
        # issue 18: a half-precision Fisher states its error against float32, measured on the
        # first rows; issue 30: within what the job's memory allowance leaves
        dev = next(model.parameters()).device
        held = sum(t.numel() * t.element_size() for d in (sums, diffs or {}) for t in d.values()
                   if t.device == dev)
        skip, check_budget_mb = precision_check_plan(model, held, spec.memory_budget_mb)
        if skip:
            out["precision_error_skipped"] = skip
        else:
            progress(0.95, "error against float32 (the model made float32 in place, the first rows)")
            with mmap_threshold_fixed():
                out["precision_error"] = precision_error(model, res.rollout, spec.estimator, check_budget_mb,
                                                         topk_percent=spec.topk_percent)
            parts["float32 error check"] = round(time.perf_counter() - t0 - t_shard, 3)
    return out


def fisher_metadata(summary: dict[str, Any], model: Any = None) -> dict[str, str]:
    """safetensors metadata of a stored Fisher: its reliability and precision travel with the
    file, so a mask, train or diff built on it can show them (compute.jobs.artifact_files.fisher_provenance).

    The model is named by label, never by server path (compute.contract.provenance): `model`
    is its resolved Ref (the worker's and the CLI's runs), recorded with the sha256 it was
    resolved with ("model_sha256": the folder's content revision; None for a hub id or an
    unhashed folder); without it, a path in summary["model"] is written as its label."""
    import json

    from compute.contract.provenance import ref_provenance, value_label
    from compute.contract.results import reliability_level

    keep = ("estimator", "model", "task", "n_prompts", "n_samples", "split_half_jaccard",
            "split_half_topk_percent", "compute_dtype", "accumulate_dtype")
    info = {k: summary.get(k) for k in keep}
    if model is not None:
        prov = ref_provenance(model)
        info["model"], info["model_sha256"] = prov["label"], prov["sha256"]
    else:
        info["model"] = value_label(info["model"], "model")
    info["reliability"] = reliability_level(summary.get("split_half_jaccard"))
    if summary.get("precision_error"):
        info["precision_relative_l1"] = summary["precision_error"].get("relative_l1")
    return {"estimator": str(summary.get("estimator")), "fisherlens": json.dumps(info, default=str)}


def run_shard(spec: FisherSpec, shard_index: int, progress: Progress = null_progress,
              refs: Refs | None = None) -> dict:
    """Un-normalised Fisher sums of one shard's prompts (tensors + JSON-able numbers).

    {"sums": {name: (*shape) float32}: the sum over both halves (batch: over minibatches),
     "diffs": {name: (*shape)}: the halves' difference, an int16 fraction of the sum (HalfSums)
     | None (batch), "diff_roundings": int, "denoms": [d_even, d_odd] | None (batch),
     "n_rows", "n_tokens", "exact": {"sums": {name: tensor}, "count"} | None, ...}"""
    return _shard(spec, shard_index, progress, None, refs)


def _add(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: a[n] + b[n] if n in a else b[n] for n in {**a, **b}}


def finish(spec: FisherSpec, shard_outputs: list[dict], progress: Progress = null_progress,
           extra: dict | None = None, refs: Refs | None = None, consume: bool = False) -> JobResult:
    """Combine shard sums into the Fisher and its statistics (`refs`: the resolved model, named
    by label and sha256 in the file's metadata). `consume=True` (run, combine: the outputs are
    theirs) empties the outputs' sums tensor by tensor, so memory is released as the Fisher is
    built."""
    progress(0.9, "statistics")
    release_freed_memory()  # what the passes and checks freed: the statistics start from the sums alone
    t_stats = time.perf_counter()
    outs = sorted(shard_outputs, key=lambda o: o["shard"])
    exact: dict[str, torch.Tensor] = {}
    exact_count = 0.0
    for o in outs:
        if o.get("exact"):
            exact = _add(exact, o["exact"]["sums"])
            exact_count += o["exact"]["count"]
    batch = spec.estimator == "batch"
    halves, denoms = _merged(outs)
    if halves is None:
        raise ValueError("prompts: no prompts were processed")
    # keep the model's parameter order (the first non-empty shard's dict order)
    order = list(halves.total)
    total = 1.0 if batch else denoms[0] + denoms[1]
    if total <= 0:
        raise ValueError("max_new_tokens: no completion tokens were sampled")
    # issue 30: the split-half Jaccard from the halves' raw sums, computed a tensor at a time from
    # the total and the difference (a half's top-k set does not depend on its denominator), then
    # the differences are released and the Fisher is the total over the denominator, divided in
    # place when the sums are this job's own (consume): the halves and the Fisher are never all
    # alive, and the job holds 6 bytes/param at most (4 after the split-half statistics).
    split_jaccard = None
    if not batch and denoms[0] > 0 and denoms[1] > 0:
        progress(0.9, "statistics: split-half overlap")
        split_jaccard = topk_jaccard_of_halves(halves, spec.topk_percent, progress)
    own = consume or len([o for o in outs if o["sums"]]) > 1  # merged sums are new tensors
    compact, roundings, bound = halves.compact, halves.roundings, halves.half_error_bound()
    halves.diff.clear()
    if consume:
        for o in outs:
            (o.get("diffs") or {}).clear()
    progress(0.94, "statistics: the Fisher from the sums")
    fisher: dict[str, torch.Tensor] = {}
    for n in order:
        fisher[n] = divide(halves.total.pop(n), total, in_place=own)
        if consume:
            for o in outs:
                o["sums"].pop(n, None)
    summary: dict[str, Any] = {
        "estimator": spec.estimator, "model": spec.model, "task": spec.task,
        "n_prompts": spec.prompts, "n_rows": sum(o["n_rows"] for o in outs),
        "n_tokens": sum(o["n_tokens"] for o in outs), "shards": len(outs),
        "seconds": round(sum(o["seconds"] for o in outs), 3), "settings": spec.model_dump(),
    }
    parts: dict[str, float] = {}
    for o in outs:
        for k, v in (o.get("seconds_parts") or {}).items():
            parts[k] = round(parts.get(k, 0.0) + v, 3)
    summary["seconds_parts"] = parts
    summary["n_samples"] = summary["n_tokens"] if spec.estimator == "token" else summary["n_rows"]
    lengths = merge_length_records([o["completion_lengths"] for o in outs if o.get("completion_lengths")])
    if lengths is not None:
        summary["completion_lengths"] = lengths
    # issue 18: the precision the Fisher was computed, accumulated and stored in
    summary["compute_dtype"] = next((o["compute_dtype"] for o in outs if o.get("compute_dtype")), None)
    summary["accumulate_dtype"] = "float32"
    # the temporaries budget the engine used (the spec's, or its automatic one: a quarter of what
    # the job could take on its device, within MAX_JOB_MEMORY_MB), the largest of the shards'
    budgets = [o["memory_budget_mb"] for o in outs if o.get("memory_budget_mb")]
    if budgets:
        summary["memory_budget_mb"] = max(budgets)
    summary["stored_dtype"] = "float32"
    perr = next((o["precision_error"] for o in outs if o.get("precision_error")), None)
    if perr:
        summary["precision_error"] = perr
    pskip = next((o["precision_error_skipped"] for o in outs if o.get("precision_error_skipped")), None)
    if pskip:
        summary["precision_error_skipped"] = pskip
    progress(0.95, "statistics: histogram of the values")
    # one pass for the summary and the curve, and one more over the bins that hold a cut (its
    # Reported view goes with the histogram: top_sums reads the values through it again)
    hist = analysis.ValueHistogram.of(analysis.Reported(
        fisher, progress, 0.95, 0.97, 2, ["statistics: histogram of the values",
                                          "statistics: concentration and Gini (the bins that hold a cut)"]))
    series = analysis.to_series(fisher, hist=hist)  # its grid holds the summary's shares
    tstats = analysis.tensor_stats(fisher)  # one pass: the summary, the layer stats and the heatmaps read it
    summary.update(analysis.summary(fisher, hist=hist, rows=tstats))
    del hist
    summary["split_half_jaccard"] = split_jaccard
    if split_jaccard is not None:
        summary["split_half_topk_percent"] = spec.topk_percent
        if compact:  # what the compact difference costs the halves, stated
            summary["split_half_precision"] = {
                "halves": "float32 total + int16 fraction of it for the difference",
                "roundings": roundings, "half_error_bound": bound}
    if exact and exact_count > 0:
        progress(0.975, "statistics: exact output-layer Fisher vs the estimate")
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
    progress(0.98, "statistics: layers and modules")
    layer_stats, heatmaps = analysis.to_layer_stats(fisher, tstats), analysis.to_heatmaps(fisher, rows=tstats)
    summary["seconds_parts"]["statistics"] = round(time.perf_counter() - t_stats, 3)
    result = JobResult(
        kind="fisher", summary=summary, layer_stats=layer_stats,
        heatmaps=heatmaps, series=series, tensors={"fisher": fisher},
        metadata={"fisher": fisher_metadata(summary, (refs or {}).get("model"))},
    )
    progress(1.0, "done")
    return result


def run(spec: FisherSpec, progress: Progress = null_progress, refs: Refs | None = None) -> JobResult:
    """Every shard in this process (model loaded once), then `finish`."""
    progress(0.0, "loading model")
    t_load = time.perf_counter()
    loaded = _load(spec, refs)
    load_s = time.perf_counter() - t_load
    from compute.lm.causal_lm import model_info

    info = model_info(loaded[0])
    outs = []
    for i in range(spec.shards):
        def sub(f: float, m: str = "", i: int = i) -> None:
            progress(0.02 + 0.88 * (i + f) / spec.shards, m)

        outs.append(_shard(spec, i, sub, loaded, refs))
    spec, outs, rounds = extend_until_reliable(spec, outs, progress, loaded, refs)
    result = finish(spec, outs, progress, extra={"model_info": info, **rounds}, refs=refs, consume=True)
    # the parts by the estimate's names (fisher.timing), the model's load first
    result.summary["seconds_parts"] = {"load": round(load_s, 3), **result.summary["seconds_parts"]}
    return result


# -- until_reliable (issue 18): more prompts until the split-half verdict is at least "fair" ----
def _merged(outs: list[dict]) -> tuple[HalfSums | None, list[float]]:
    """The shard outputs' sums as one HalfSums (batch: no differences held, 2 bytes/param of
    zeros saved) and the summed denominators; None when no shard has sums. One shard's tensors
    are handed over."""
    parts = [HalfSums(dict(o["sums"]), dict(o.get("diffs") or {}), int(o.get("diff_roundings") or 0))
             for o in outs if o["sums"]]
    denoms = [0.0, 0.0]
    for o in outs:
        if o["denoms"] is not None:
            denoms = [denoms[0] + o["denoms"][0], denoms[1] + o["denoms"][1]]
    if not parts:
        return None, denoms
    return HalfSums.merged(parts), denoms


def split_half(outs: list[dict], topk_percent: float) -> float | None:
    """The split-half top-k Jaccard of the Fisher the shard outputs sum to (None: batch)."""
    if any(o["denoms"] is None for o in outs):
        return None
    halves, denoms = _merged(outs)
    if halves is None or denoms[0] <= 0 or denoms[1] <= 0:
        return None
    return topk_jaccard_of_halves(halves, topk_percent)


def divide(s: torch.Tensor, total: float, in_place: bool = False, chunk: int = 1 << 20) -> torch.Tensor:
    """s / total as float32, each value the float32 nearest its float64 quotient (over chunks of
    `chunk` values: no float64 copy of the whole tensor); in place when the caller owns s.

    Where s is float32 and the denominator a float32 (a count of rows or tokens below 2^24), one
    float32 division gives the same bits (a quotient of two floats rounded to float64 then to
    float32 equals it rounded once: 53 >= 2 x 24 + 2) at a tenth of the time: the float64 route
    was the second largest part of a small job's statistics (issue 30, bench_stat_ops.py). The
    divisor is a one-value tensor on the device, not a Python number: CUDA divides by a CPU scalar
    as a multiplication by its reciprocal, which is not the same bits."""
    out = s if in_place and s.dtype == torch.float32 else torch.empty(s.shape, dtype=torch.float32,
                                                                        device=s.device)
    src, dst = s.reshape(-1), out.view(-1)
    if s.dtype == torch.float32 and float(torch.tensor(total, dtype=torch.float32)) == total:
        torch.div(src, torch.full((1,), total, dtype=torch.float32, device=s.device), out=dst)
        return out
    for o in range(0, src.numel(), chunk):
        dst[o:o + chunk] = (src[o:o + chunk].double() / total).float()
    return out


def topk_jaccard_of_halves(halves: HalfSums, topk_percent: float, progress: Progress | None = None) -> float:
    """Top-k% Jaccard of the two halves' Fishers, each half made a slice at a time; `progress`
    hears of each slice of its passes (0.90 -> 0.94 of the job)."""
    a: Any = halves.view(0)
    if progress is not None:  # the halves are read side by side: one side's slices tell both
        passes = analysis.topk_jaccard_passes(a.numel())
        a = analysis.Reported(a, progress, 0.90, 0.94, passes,
                              f"statistics: split-half overlap ({'one pass' if passes == 1 else 'two passes'} over both halves)")
    return analysis.topk_jaccard(a, halves.view(1), topk_percent)


def extend_until_reliable(spec: FisherSpec, outs: list[dict], progress: Any = null_progress,
                          loaded: tuple | None = None, refs: Refs | None = None,
                          ) -> tuple[FisherSpec, list[dict], dict]:
    """With spec.until_reliable: while the split-half Jaccard is below FAIR_JACCARD and the
    prompts can double within spec.max_prompts, estimate on as many further prompts again (the
    sums add: the Fisher is a mean) -> (spec with the prompts used, outputs, summary extras)."""
    from compute.contract.results import FAIR_JACCARD

    if not spec.until_reliable or spec.estimator == "batch":
        return spec, outs, {}
    outs = list(outs)
    rounds = [{"prompts": spec.prompts, "split_half_jaccard": split_half(outs, spec.topk_percent)}]
    total = spec.prompts
    while (rounds[-1]["split_half_jaccard"] is not None and rounds[-1]["split_half_jaccard"] < FAIR_JACCARD
           and 2 * total <= spec.max_prompts):
        extra = FisherSpec.model_validate({**spec.model_dump(), "prompts": total, "shards": 1,
                                           "prompt_start": spec.prompt_start + total, "until_reliable": False})
        loaded = loaded or _load(spec, refs)
        progress(0.5, f"split-half Jaccard {rounds[-1]['split_half_jaccard']:.3f} < {FAIR_JACCARD}: "
                      f"{total} more prompts")
        quiet: Any = null_progress
        out = _shard(extra, 0, quiet, loaded)
        out["shard"] = max(o["shard"] for o in outs) + 1
        out.pop("precision_error", None)  # measured once, on the first rows
        outs.append(out)
        total *= 2
        rounds.append({"prompts": total, "split_half_jaccard": split_half(outs, spec.topk_percent)})
    final = FisherSpec.model_validate({**spec.model_dump(), "prompts": total})
    note = ("reached 'fair'" if (rounds[-1]["split_half_jaccard"] or 0) >= FAIR_JACCARD else
            f"still below 'fair' at max_prompts={spec.max_prompts}")
    return final, outs, {"until_reliable": {"rounds": rounds, "prompts_asked": spec.prompts,
                                            "prompts_used": total, "note": note}}


# -- child units (the protocol of compute/jobs/runners.py): one child per prompt shard --------------
def children(spec: FisherSpec) -> int:
    return spec.shards


def run_child(spec: FisherSpec, index: int, progress: Progress = null_progress,
              refs: Refs | None = None) -> dict:
    return run_shard(spec, index, progress, refs)


def combine(spec: FisherSpec, outputs: list[dict], progress: Progress = null_progress,
            refs: Refs | None = None) -> JobResult:
    spec, outputs, rounds = extend_until_reliable(spec, outputs, progress, refs=refs)  # loads the model if needed
    return finish(spec, outputs, progress, extra=rounds, refs=refs, consume=True)
