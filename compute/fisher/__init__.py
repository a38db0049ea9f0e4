"""Exact, fast diagonal Fisher of causal LMs from per-sample gradients (docs/science.md section 2).

How: one batched forward + one backward that computes only activation gradients (never the
parameter .grad). Forward hooks on every module that owns parameters save its inputs; a tensor
hook on its output receives d(loss)/d(output). Because rows never interact in a causal LM forward,
the output gradient of row n is the gradient of row n's own summed completion log-prob, so each
row's parameter gradient is rebuilt exactly from (input, output-grad) of that row
(`persample`: Linear, Conv1D, rank-1 rows, embeddings incl. scaled ones, affine norms, and a
generic vmap(vjp) path for anything else). Parameters used by several modules (tied embeddings)
have their per-row gradients summed over all uses before squaring. Per-row maths runs in float32
even for a bf16 model (compute.lm.device holds every dtype decision).

Never silently wrong: a model is verified once (per-row gradients add up to autograd's), every
call checks that each parameter autograd reaches was covered by a hook, and whatever the engine
cannot make exact raises `UnsupportedModel` naming the module or parameters and the reason.

Layout: hooks.py (capture x and g inside a context manager, refusals), persample.py (pure
per-layer maths on tensors: linear, Conv1D, rank-1, bias, embedding, affine, generic),
accumulate.py (per-group sums, shared parameters, routing a captured call to the maths),
estimators.py (sequence, token, batch; padding, sorting, chunking, verification),
exact_output.py (closed-form output layer), this module (FisherConfig, FisherEstimate,
estimate_fisher end to end).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, get_args

import torch
from pydantic import Field, ValidationError
from torch import nn

from compute.contract.cost import fisher_chunks
from compute.contract.jobresult import Progress, null_progress
from compute.contract.specs import Estimator, FisherKnobs, SpecError, friendly_error
from compute.fisher.accumulate import HalfSums
from compute.fisher.estimators import (
    batch_fisher,
    expand_tokens,
    fisher_from_samples,
    fisher_sums,
    new_store,
    per_sample_square_sums,
    right_padded,
    rows_per_forward,
    trainable_parameters,
)
from compute.fisher.exact_output import ExactOutputUnsupported, exact_output_fisher
from compute.fisher.hooks import UnsupportedModel
from compute.lm.device import default_budget_mb, model_device
from compute.lm.sampling import Rollout, build_rollout, sample_completions

ESTIMATORS: tuple[str, ...] = get_args(Estimator)


class FisherConfig(FisherKnobs):
    """The engine's configuration: the estimator's knobs with the fisher job's defaults and ranges
    (compute.contract.specs.FisherKnobs, the one schema), plus the batching the engine chooses
    itself. Build it from a spec with `FisherConfig.of(spec, **over)`; bad values raise
    compute.contract.specs.SpecError naming the field and its accepted range."""

    batch_size: int | None = Field(None, ge=1, le=1_000_000,
        description="rows per forward/backward (None = from the memory budget); minibatch size of "
                    "the batch estimator (None = 8)")
    sample_batch_size: int | None = Field(64, ge=1, le=1_000_000, description="rows per generation batch")

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise SpecError([friendly_error(e, type(self)) for e in exc.errors()]) from None

    @classmethod
    def of(cls, spec: Any, **over: Any) -> FisherConfig:
        """The config of a spec: every FisherKnobs field the spec has, then `over`."""
        names = set(cls.model_fields)
        return cls(**{**{n: getattr(spec, n) for n in type(spec).model_fields if n in names}, **over})


@dataclass
class FisherEstimate:
    """fisher: name -> float32 (param shape). n_rows sequences, n_tokens counted tokens.

    halves: per-parameter sums over two independent halves of the samples (even / odd prompt
    index) as HalfSums (their exact float32 total and their difference), with half_denoms: their
    denominators (for split-half stability). With halves, `fisher` is made from the total on first
    use, so a caller that needs only the sums (the fisher job) never holds both (issue 30).
    """

    fisher_: dict[str, torch.Tensor] | None
    n_rows: int
    n_tokens: int
    estimator: str
    settings: dict[str, Any]
    halves: HalfSums | None = None
    half_denoms: tuple[float, float] | None = None
    rollout: Rollout | None = None

    @property
    def fisher(self) -> dict[str, torch.Tensor]:
        if self.fisher_ is None:
            if self.halves is None or self.half_denoms is None:
                raise ValueError("fisher: this estimate has neither a Fisher nor half sums")
            total = sum(self.half_denoms)
            self.fisher_ = {n: s / total for n, s in self.halves.total.items()}
        return self.fisher_

    @property
    def n_samples(self) -> int:
        return self.n_tokens if self.estimator == "token" else self.n_rows

    def half(self, k: int) -> dict[str, torch.Tensor]:
        """Fisher estimated from half k (0 or 1) of the samples alone."""
        if self.halves is None or self.half_denoms is None:
            raise ValueError("halves: this result has no half-split sums")
        d = max(self.half_denoms[k], 1e-30)
        return {n: self.halves.half(n, k).div_(d) for n in self.halves.total}


def _prompts_and_answers(task_or_prompts: Any, config: FisherConfig) -> tuple[list[str], list[str] | None]:
    if isinstance(task_or_prompts, (list, tuple)):
        items = list(task_or_prompts)
        if items and all(isinstance(x, str) for x in items):
            return items, None
        return [x.prompt for x in items], [x.answer for x in items]  # Examples
    ex = task_or_prompts.examples(config.prompts, seed=config.seed, split="train",
                                  start=config.prompt_start)
    return [e.prompt for e in ex], [e.answer for e in ex]


def _half_sums(model: nn.Module, roll: Rollout, n_prompts: int, est: str, config: FisherConfig,
               prog: Progress) -> tuple[HalfSums, torch.Tensor, float]:
    """(the sums over the even / odd prompt halves, (2,) denominators, seconds of the engine's
    self-check): sequence in one call of the engine (its rows sorted by length, progress after
    each forward), token in chunks of prompts (fisher_chunks) so its expanded rows stay bounded."""
    groups = ((roll.prompt_index + config.prompt_start) % 2).cpu()
    store = new_store(model, 2)  # one set of accumulators for every chunk (issue 30)
    denom = torch.zeros(2, dtype=torch.float64)
    engine_rows = int(roll.completion_mask.sum()) if est == "token" else len(roll)
    per_forward = config.batch_size or rows_per_forward(
        model, int(roll.input_ids.shape[1]), config.memory_budget_mb)
    n_chunks = fisher_chunks(est, n_prompts, engine_rows, per_forward)  # the cost model reads the same
    bounds = [round(i * n_prompts / n_chunks) for i in range(n_chunks + 1)]
    for c in range(n_chunks):
        rows = ((roll.prompt_index >= bounds[c]) & (roll.prompt_index < bounds[c + 1])).cpu()
        idx = rows.nonzero().squeeze(1)
        if idx.numel() == 0:
            continue
        sub = roll.select(idx)

        def step(done: int, total: int, c: int = c) -> None:
            frac = (c + done / max(1, total)) / n_chunks
            where = f"chunk {c + 1}/{n_chunks}, " if n_chunks > 1 else ""
            prog(0.3 + 0.7 * frac, f"fisher: {where}{done}/{total} {'token rows' if est == 'token' else 'rows'}")
        _, d = fisher_sums(model, sub.input_ids, sub.attention_mask, sub.completion_mask,
                           est, None, groups[idx], 2, config.memory_budget_mb,
                           config.batch_size, into=store, progress=step)
        denom += d
    return store.finish_halves(), denom, store.check_seconds


def estimate_fisher(
    model: nn.Module, tokenizer: Any, task_or_prompts: Any, config: FisherConfig,
    progress: Progress | None = None,
) -> FisherEstimate:
    """Sample on-policy (sequence/token) or take gold answers (empirical/batch), then estimate.

    task_or_prompts: a compute.lm.verifiable_tasks.Task, a list of prompt strings, or a list of Examples.
    Rows are processed in chunks of prompts with progress(fraction, message) after each chunk.
    """
    prog = progress or null_progress
    prompts, answers = _prompts_and_answers(task_or_prompts, config)
    if not prompts:
        raise ValueError("prompts: no prompts to estimate the Fisher on")
    if config.estimator in ("empirical", "batch") and answers is None:
        raise ValueError(f"estimator: {config.estimator!r} needs gold answers; pass a task or "
                         "Examples, not bare prompt strings")
    t0 = time.perf_counter()
    prog(0.0, "sampling" if config.estimator in ("sequence", "token") else "tokenizing")
    if config.estimator in ("sequence", "token"):
        roll = sample_completions(
            model, tokenizer, prompts, config.samples, config.max_new_tokens, config.temperature,
            config.top_k, config.top_p, config.seed, config.sample_batch_size,
            prompt_offset=config.prompt_start)
    else:
        roll = build_rollout(tokenizer, prompts, answers or [], device=model_device(model))
    prog(0.3, f"sampled {len(roll)} sequences")
    t_sample = time.perf_counter() - t0
    est = "sequence" if config.estimator == "empirical" else config.estimator
    asked_budget = config.memory_budget_mb
    if config.memory_budget_mb is None:
        # the automatic budget fixed once, before the sums are allocated, for every pass of the
        # job (each pass had read the free memory again, smaller by the sums), and stated in the
        # result: what the job used against what the estimate said (issue 30)
        config = config.model_copy(update={"memory_budget_mb": default_budget_mb(model_device(model))})
    n_tokens = int(roll.completion_mask.sum())
    halves = half_denoms = None
    check_s = 0.0
    if est == "batch":
        fisher = batch_fisher(model, roll.input_ids, roll.attention_mask, roll.completion_mask,
                              config.batch_size or 8)
    else:
        sums, denom, check_s = _half_sums(model, roll, len(prompts), est, config, prog)
        if float(denom.sum()) <= 0:
            raise ValueError("completion_mask: no counted tokens")
        halves = sums.to_cpu_float32()
        fisher = None  # FisherEstimate.fisher: made from the halves on first use
        half_denoms = (float(denom[0]), float(denom[1]))
    settings = config.model_dump() | {"memory_budget_mb": asked_budget}
    settings.update(n_prompts=len(prompts), estimator_used=est, memory_budget_mb_used=config.memory_budget_mb,
                    sample_seconds=round(t_sample, 3),
                    check_seconds=round(check_s, 3),
                    total_seconds=round(time.perf_counter() - t0, 3))
    prog(1.0, "done")
    return FisherEstimate(fisher, len(roll), n_tokens, config.estimator, settings, halves,
                        half_denoms, roll)


def l1_parts(est: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(||est - ref||_1, ||ref||_1) in float64 over slices of a million values: no float64 copy
    of a whole tensor (a 151,936 x 2,048 embedding would be 2.5 GB)."""
    if est.shape != ref.shape:
        raise ValueError(f"fisher: shapes differ: {tuple(est.shape)} vs {tuple(ref.shape)}")
    e, r = est.detach().reshape(-1), ref.detach().reshape(-1)
    num = den = 0.0
    for o in range(0, r.numel(), 1 << 20):
        rc = r[o:o + (1 << 20)].double()
        num += float((e[o:o + (1 << 20)].double() - rc).abs().sum())
        den += float(rc.abs().sum())
    return num, den


def relative_error(est: torch.Tensor, ref: torch.Tensor) -> float:
    """||est - ref||_1 / ||ref||_1 (0 when both vanish), streamed (l1_parts)."""
    num, den = l1_parts(est, ref)
    return 0.0 if den == 0 and num == 0 else (num / den if den > 0 else math.inf)


__all__ = [
    "ESTIMATORS", "ExactOutputUnsupported", "FisherConfig", "FisherEstimate", "UnsupportedModel",
    "batch_fisher", "estimate_fisher", "exact_output_fisher", "expand_tokens",
    "fisher_from_samples", "fisher_sums", "l1_parts", "per_sample_square_sums", "relative_error",
    "right_padded", "trainable_parameters",
]
