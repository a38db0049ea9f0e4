"""The training loop: any objective (compute.train.objectives), the mask-aware optimizer, the
gradient sums, the evaluation before and after. Algorithm-specific work is in the objectives.

Prompts of step s are train-split items s*batch .. (s+1)*batch-1 of task.examples(seed=seed);
sampling is seeded by (seed, step), so a masked and a full run with the same config see the same
prompts and (until the policies diverge) the same random numbers.
"""

from __future__ import annotations

import copy
import json
import math
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from compute.contract.cost import length_record
from compute.contract.jobresult import Progress, null_progress
from compute.train.config import TrainConfig
from compute.train.objectives import Batch, Objective, make_objective
from compute.train.optimizers import (
    Coords,
    MaskedOptimizer,
    Param,
    clip_grad_norm,
    grads_of,
    mask_gradients,
    prepare_masked_params,
    prepare_precision,
    stored_dtype,
    trainable_count,
)

Params = list[Param]
GradHook = Callable[[int, Params], None]
StepHook = Callable[[int, torch.nn.Module, list[dict[str, float]]], None]


@dataclass
class TrainOutcome:
    curve: list[dict[str, float]]  # one row per step: reward, loss, grad_norm, ... (+ accuracy)
    accuracy_before: float
    accuracy_after: float
    settings: dict[str, Any]
    seconds: float
    trainable_fraction: float
    updates: int = 0  # optimizer updates taken (steps x inner steps, minus skipped steps)
    eval_seconds: float = 0.0  # of `seconds`, the greedy held-out evaluations (before, during, after)
    # with config.track_gradients: per coordinate sum over updates of g^2 and of |g|, where g is
    # the masked, unclipped gradient of the training loss (float32, CPU; accumulated at the
    # mask's coordinates only, each tensor made dense when read: 0 off the mask)
    grad_sq_sum: Mapping[str, torch.Tensor] | None = None  # a SparseSums
    grad_abs_sum: Mapping[str, torch.Tensor] | None = None
    # how long the sampled completions ran, every step's (compute.contract.cost.length_record;
    # None when nothing was sampled: SFT on gold answers)
    completion_lengths: dict[str, Any] | None = None


class _Step:
    """One optimizer update of an objective on a batch: backward, mask, gradient sums, hook,
    clip, step. Holds what stays fixed over the run."""

    def __init__(self, model: torch.nn.Module, params: Params, config: TrainConfig,
                 grad_hook: GradHook | None):
        c = config
        self.params, self.clip, self.hook = params, c.grad_clip, grad_hook
        self.opt = MaskedOptimizer(params, c.optimizer, c.lr, c.weight_decay, (c.beta1, c.beta2),
                                   c.adam_eps, c.momentum, model=model)
        self.updates = 0
        self.sq: dict[str, torch.Tensor] | None = None
        self.abs: dict[str, torch.Tensor] | None = None
        if c.track_gradients:  # float32 sums of the trained coordinates only (1-D at a Coords)
            self.sq = {n: torch.zeros(p.shape if m is None else (m.count,), dtype=torch.float32,
                                      device=p.device) for n, p, m in params}
            self.abs = {n: torch.zeros_like(t) for n, t in self.sq.items()}

    def __call__(self, objective: Objective, model: torch.nn.Module, batch: Batch, step: int) -> dict[str, float]:
        self.opt.zero_grad()
        loss, stats = objective.loss(model, batch)
        loss.backward()  # the optimizer's hooks fold a partly masked tensor's gradient as it arrives
        mask_gradients(self.params)
        if self.sq is not None and self.abs is not None:
            with torch.no_grad():
                for n, g, _c in grads_of(self.params):
                    g = g.detach().float()
                    self.sq[n].addcmul_(g, g)
                    self.abs[n].add_(g.abs())
        self.updates += 1
        if self.hook is not None:
            self.hook(step, self.params)
        grad_norm = clip_grad_norm(self.params, self.clip)
        self.opt.step()
        return {"grad_norm": grad_norm, "loss": float(loss.detach()), **{k: float(v) for k, v in stats.items()}}


def train(
    model: torch.nn.Module,
    tokenizer: Any,
    task: Any,
    config: TrainConfig,
    mask: Mapping[str, torch.Tensor] | None = None,
    teacher: torch.nn.Module | None = None,
    teacher_tokenizer: Any = None,
    progress: Progress | None = None,
    evaluate: bool = True,
    grad_hook: GradHook | None = None,
    step_hook: StepHook | None = None,
) -> TrainOutcome:
    """Train `model` in place on `task` with config.algo's objective; returns curves and accuracies.

    mask: name -> bool (True = trainable); frozen coordinates stay bit-identical. grad_hook(step,
    params) sees the masked, unclipped gradients before each optimizer step (a dense tensor's
    .grad; a partly masked one's at its Coords, compute.train.optimizers.grads_of); step_hook(step,
    model, curve) runs after each step (1-based; e.g. to save a checkpoint). Each parameter's
    requires_grad is restored on return, also when training fails."""
    progress = progress or null_progress
    torch.manual_seed(config.seed)
    prepare_precision(model, config.precision)
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    update: _Step | None = None
    checkpointing = _gradient_checkpointing(model, config.gradient_checkpointing)
    try:
        objective = make_objective(config, model, tokenizer, task, teacher, teacher_tokenizer)
        params = prepare_masked_params(model, mask)
        update = _Step(model, params, config, grad_hook)
        t0 = time.perf_counter()
        evals = [0.0]  # seconds of the evaluations among the loop's

        def accuracy() -> float:
            t = time.perf_counter()
            try:
                return _accuracy(model, tokenizer, task, config)
            finally:
                evals[0] += time.perf_counter() - t

        before = accuracy() if evaluate else math.nan
        curve: list[dict[str, float]] = []
        lengths: list[tuple[int, bool]] = []
        for step in range(config.steps):
            model.train()
            batch = objective.make_batch(model, step)
            lengths += batch.sampled or []
            row: dict[str, float] = {"step": step + 1, **batch.metrics}
            for _ in range(objective.updates if len(batch) else 0):  # no rows: nothing to learn
                row.update(update(objective, model, batch, step))
            if config.eval_every and (step + 1) % config.eval_every == 0 and step + 1 < config.steps:
                row["accuracy"] = accuracy()
            curve.append(row)
            if step_hook is not None:
                step_hook(step + 1, model, curve)
            progress((step + 1) / config.steps, _message(row, step, config.steps, len(batch)))
        model.eval()
        after = accuracy() if evaluate else math.nan
    finally:
        if checkpointing:
            _checkpointing_method(model, "disable")()
        if update is not None:
            update.opt.close()
            update.opt.zero_grad()
        for n, p in model.named_parameters():
            p.requires_grad_(flags[n])
    assert update is not None  # set before any step (an exception above propagates)
    res = _result(model, config, mask, params, update, curve, before, after, time.perf_counter() - t0)
    res.eval_seconds = evals[0]
    res.completion_lengths = length_record(lengths, config.max_new_tokens) if lengths else None
    return res


def _gradient_checkpointing(model: torch.nn.Module, on: bool) -> bool:
    """Turn on transformers' activation (gradient) checkpointing for the run, non-reentrant (the
    masked layers' folds and hooks run once, in the recomputed backward); True when this call did.
    A model that already has it on keeps it; one that cannot is refused, naming the field."""
    if not on or _checkpointing_on(model):
        return False
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"gradient_checkpointing: {type(model).__name__} does not support it; accepted: false")
    _checkpointing_method(model, "enable")(**{
        "activation_checkpointing_kwargs" if hasattr(model, "activation_checkpointing_enable")
        else "gradient_checkpointing_kwargs": {"use_reentrant": False}})
    return True


def _checkpointing_method(model: torch.nn.Module, what: str) -> Any:
    """transformers 5 names it activation_checkpointing_*, 4.x gradient_checkpointing_* (5 warns)."""
    new = getattr(model, f"activation_checkpointing_{what}", None)
    return new if new is not None else getattr(model, f"gradient_checkpointing_{what}")


def _checkpointing_on(model: torch.nn.Module) -> bool:
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


def _accuracy(model: torch.nn.Module, tokenizer: Any, task: Any, config: TrainConfig) -> float:
    from compute.lm.causal_lm import greedy_accuracy

    return greedy_accuracy(model, tokenizer, task, n=config.eval_prompts, split="test", seed=0,
                           max_new_tokens=config.eval_max_new_tokens)


def _message(row: dict[str, float], step: int, steps: int, rows: int) -> str:
    if not rows:
        return f"step {step + 1}/{steps}: no rewarded sample"
    return f"step {step + 1}/{steps}" + (f" reward {row['reward']:.3f}" if "reward" in row else "")


def _result(model: torch.nn.Module, config: TrainConfig, mask: Any, params: Params, update: _Step,
            curve: list[dict[str, float]], before: float, after: float, seconds: float) -> TrainOutcome:
    n_total = sum(p.numel() for p in model.parameters())
    n_train = trainable_count(params)
    settings = asdict(config)
    settings["masked"] = mask is not None
    settings["compute_dtype"] = "bfloat16" if config.precision == "bf16" else "float32"
    settings["stored_dtype"] = str(stored_dtype(config.precision)).replace("torch.", "")
    settings["optimizer_state_dtype"] = "float32"
    res = TrainOutcome(curve, before, after, settings, seconds, n_train / max(1, n_total), update.updates)
    if update.sq is not None and update.abs is not None:
        res.grad_sq_sum = SparseSums(model, params, update.sq)
        res.grad_abs_sum = SparseSums(model, params, update.abs)
        update.sq = update.abs = None
    return res


class SparseSums(Mapping[str, torch.Tensor]):
    """name -> dense float32 CPU tensor of a per-coordinate sum kept at the mask's coordinates
    only (1-D at a Coords; 0 off the mask and for frozen parameters): each tensor is made dense
    when it is read, so holding the sums costs the mask's size, not the model's."""

    def __init__(self, model: torch.nn.Module, params: Params, sums: dict[str, torch.Tensor]):
        self.shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        self.coords: dict[str, Coords | None] = {n: c for n, _p, c in params}
        self.sums = {n: t.cpu() for n, t in sums.items()}

    def __getitem__(self, name: str) -> torch.Tensor:
        shape = self.shapes[name]  # KeyError for a name that is not a parameter
        t, c = self.sums.get(name), self.coords.get(name)
        if t is None:
            return torch.zeros(shape, dtype=torch.float32)
        return t if c is None else c.dense(t, shape)

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


def save_output(
    model: Any, tokenizer: Any, out_dir: str | Path, metrics: Mapping[str, Any],
    precision: str = "fp32",
) -> Path:
    """Write the trained model (a transformers PreTrainedModel: it has save_pretrained) +
    tokenizer (HF format) and metrics.json into out_dir.

    precision 'bf16-mixed' / 'bf16' save the weights in bfloat16 (as published checkpoints are)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if precision != "fp32":
        stored = copy.deepcopy(model).to(stored_dtype(precision))
        stored.save_pretrained(out)
        del stored
    else:
        model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True, default=str))
    return out


def save_checkpoint(
    model: torch.nn.Module, tokenizer: Any, out_dir: str | Path, step: int, curve: list[dict[str, float]],
    max_steps: int, save_steps: int, precision: str = "fp32",
) -> Path:
    """OUT/checkpoint-<step>/ in the HF Trainer / TRL layout: the weights in the stored dtype
    (model.safetensors), config.json, the tokenizer, and trainer_state.json (global_step and the
    logged rows so far), so `fisherlens series BASE OUT` reads it like a TRL run folder.
    Written to a temporary name and renamed, so a reader never sees half a checkpoint."""
    out = Path(out_dir)
    final = out / f"checkpoint-{step}"
    tmp = out / f"tmp-checkpoint-{step}"
    save_output(model, tokenizer, tmp, {"step": step}, precision=precision)
    (tmp / "metrics.json").unlink()
    state = {"global_step": step, "max_steps": max_steps, "save_steps": save_steps,
             "log_history": [{k: (v if math.isfinite(v) else None) for k, v in r.items()} for r in curve],
             "written_by": "fisherlens train"}
    (tmp / "trainer_state.json").write_text(json.dumps(state, indent=2, sort_keys=True, default=str))
    tmp.rename(final)
    return final


def objective_gradient(
    model: torch.nn.Module, tokenizer: Any, task: Any, config: TrainConfig,
    teacher: torch.nn.Module | None = None,
) -> dict[str, torch.Tensor]:
    """|gradient| (float32, CPU) of the training objective on the first batch at the start
    (for the 'gradient' mask selector). The model is not changed (a copy takes the step)."""
    captured: dict[str, torch.Tensor] = {}

    def hook(step: int, params: Params) -> None:
        if step == 0 and not captured:
            for n, p, _m in params:
                g = p.grad
                captured[n] = (g.detach().abs().float().cpu() if g is not None
                               else torch.zeros(p.shape, dtype=torch.float32))

    cfg = replace(config, steps=1)
    train(copy.deepcopy(model), tokenizer, task, cfg, teacher=teacher, evaluate=False, grad_hook=hook)
    return captured
