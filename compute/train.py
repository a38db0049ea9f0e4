"""Masked post-training loop: GRPO, on-policy distillation (OPD) or SFT, with AdamW or SGD.

A fixed mask (name -> bool tensor, True = trainable) freezes every excluded coordinate
completely. `MaskedOptimizer` is our own AdamW/SGD step, written so that frozen coordinates stay
bit-identical:
- gradients are multiplied by the mask right after backward, before clipping (so the clip norm
  only sees trainable coordinates) and before the optimizer;
- Adam moments start at 0 and only ever receive masked gradients, so they stay exactly 0 off
  the mask; the Adam update there is 0 / (sqrt(0) + eps) = 0 exactly;
- decoupled weight decay is applied as lr * wd * p * mask (torch's AdamW multiplies the whole
  tensor by 1 - lr * wd, which would shrink frozen weights); SGD's coupled decay wd * p is
  likewise masked before it enters the momentum buffer;
- the weight is changed by p -= update with update exactly 0 (+0.0) off the mask, and x - 0.0 == x
  bit for bit for every finite x (including -0.0).
Tensors entirely outside the mask get requires_grad = False (no gradient is computed for them);
tensors entirely inside carry no mask (no extra work).
The maths of each objective lives in compute.grpo / compute.distill / compute.sft.
"""

from __future__ import annotations

import copy
import json
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from compute.distill import ESTIMATORS, check_same_tokenizer, distill_loss
from compute.grpo import AGGREGATIONS, group_advantages, grpo_loss
from compute.sft import SOURCES, keep_rewarded, sft_loss

ALGOS = ("grpo", "opd", "sft")
OPTIMIZERS = ("adamw", "sgd")
# Precision of training (SCIENCE.md section 6):
# - fp32: float32 weights, float32 checkpoint;
# - bf16-mixed: float32 master weights that start from the base rounded to bf16 (a published bf16
#   checkpoint), float32 forward/backward, and a checkpoint saved in bf16 (as HF models are
#   published): a stored weight changes only when the accumulated update crosses a bf16 rounding
#   boundary;
# - bf16: weights held in bf16 (forward/backward in bf16, optimizer state float32); each step
#   writes round_bf16(w - update), so an update below half a bf16 ULP of |w| is lost.
PRECISIONS = ("fp32", "bf16-mixed", "bf16")


@dataclass
class TrainConfig:
    algo: str = field(default="grpo", metadata={"help": "grpo | opd (on-policy distillation) | sft"})
    optimizer: str = field(default="adamw", metadata={"help": "adamw | sgd (both mask-aware)"})
    lr: float = field(default=1e-3, metadata={"help": "learning rate"})
    weight_decay: float = field(
        default=0.0, metadata={"help": "AdamW: decoupled decay; SGD: L2 added to the gradient"}
    )
    beta1: float = field(default=0.9, metadata={"help": "AdamW first-moment decay"})
    beta2: float = field(default=0.999, metadata={"help": "AdamW second-moment decay"})
    adam_eps: float = field(default=1e-8, metadata={"help": "AdamW denominator epsilon"})
    momentum: float = field(default=0.0, metadata={"help": "SGD momentum"})
    steps: int = field(default=30, metadata={"help": "optimizer steps (one sampled batch each)"})
    batch: int = field(default=8, metadata={"help": "prompts per step"})
    group: int = field(
        default=8, metadata={"help": "completions sampled per prompt (GRPO group; OPD / self-SFT samples)"}
    )
    seed: int = field(default=0, metadata={"help": "seed of prompts, sampling and torch"})
    max_new_tokens: int = field(default=16, metadata={"help": "sampled completion length cap"})
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature"})
    grad_clip: float | None = field(
        default=1.0, metadata={"help": "max global grad norm (of the masked gradient); None = off"}
    )
    clip_eps: float = field(default=0.2, metadata={"help": "GRPO ratio clip range"})
    kl_coef: float = field(default=0.0, metadata={"help": "GRPO k3 KL-to-reference coefficient"})
    scale_std: bool = field(default=True, metadata={"help": "GRPO: divide advantages by group std"})
    inner_steps: int = field(default=1, metadata={"help": "GRPO updates per sampled batch"})
    aggregation: str = field(default="token", metadata={"help": "loss mean over 'token' or 'sequence'"})
    distill_estimator: str = field(default="full", metadata={"help": "OPD: 'full' or 'sampled' reverse KL"})
    sft_source: str = field(default="gold", metadata={"help": "SFT: 'gold' answers or 'self' samples"})
    eval_prompts: int = field(default=200, metadata={"help": "held-out test prompts for greedy accuracy"})
    eval_every: int = field(default=0, metadata={"help": "greedy eval every k steps (0 = before/after)"})
    eval_max_new_tokens: int = field(default=8, metadata={"help": "greedy eval completion cap"})
    precision: str = field(
        default="fp32",
        metadata={"help": "fp32 | bf16-mixed (fp32 master weights, bf16 checkpoint) | bf16 (bf16 weights)"},
    )
    track_gradients: bool = field(
        default=False,
        metadata={"help": "accumulate per-coordinate sum g^2 and sum |g| of the (masked, unclipped) "
                  "training gradient over all updates"},
    )

    def __post_init__(self) -> None:
        if self.algo not in ALGOS:
            raise ValueError(f"algo: got {self.algo!r}; accepted: {', '.join(ALGOS)}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer: got {self.optimizer!r}; accepted: {', '.join(OPTIMIZERS)}")
        for name in ("lr",):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: got {getattr(self, name)}; must be > 0")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay: got {self.weight_decay}; must be >= 0")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ValueError(f"beta1/beta2: got {self.beta1}, {self.beta2}; each must be in [0, 1)")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"momentum: got {self.momentum}; must be in [0, 1)")
        for name in ("steps", "batch", "max_new_tokens", "inner_steps", "eval_prompts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: got {getattr(self, name)}; must be >= 1")
        if self.algo == "grpo" and self.group < 2:
            raise ValueError(f"group: got {self.group}; GRPO needs >= 2 completions per prompt")
        if self.group < 1:
            raise ValueError(f"group: got {self.group}; must be >= 1")
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ValueError(f"grad_clip: got {self.grad_clip}; must be > 0 or None")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation: got {self.aggregation!r}; accepted: {', '.join(AGGREGATIONS)}")
        if self.distill_estimator not in ESTIMATORS:
            raise ValueError(
                f"distill_estimator: got {self.distill_estimator!r}; accepted: {', '.join(ESTIMATORS)}"
            )
        if self.sft_source not in SOURCES:
            raise ValueError(f"sft_source: got {self.sft_source!r}; accepted: {', '.join(SOURCES)}")
        if self.eval_every < 0:
            raise ValueError(f"eval_every: got {self.eval_every}; must be >= 0")
        if not self.temperature > 0:
            raise ValueError(f"temperature: got {self.temperature}; must be > 0")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision: got {self.precision!r}; accepted: {', '.join(PRECISIONS)}")


# ---------------------------------------------------------------------------------------------
# Precision
# ---------------------------------------------------------------------------------------------


def prepare_precision(model: torch.nn.Module, precision: str) -> torch.nn.Module:
    """Cast `model` in place for training at `precision` (idempotent).

    fp32: float32 weights. bf16-mixed: float32 weights holding bf16-representable values (the base
    rounded to bf16 once, as if loaded from a bf16 checkpoint). bf16: bfloat16 weights.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision: got {precision!r}; accepted: {', '.join(PRECISIONS)}")
    if precision == "bf16":
        return model.to(torch.bfloat16)
    if precision == "bf16-mixed":
        with torch.no_grad():
            for p in model.parameters():
                p.data = p.data.to(torch.bfloat16).to(torch.float32)
            for b in model.buffers():
                if b.is_floating_point():
                    b.data = b.data.to(torch.float32)
        return model
    return model.to(torch.float32)


def stored_dtype(precision: str) -> torch.dtype:
    """dtype of the saved checkpoint at `precision` (what a published checkpoint holds)."""
    return torch.float32 if precision == "fp32" else torch.bfloat16


def stored_state(model: torch.nn.Module, precision: str) -> dict[str, torch.Tensor]:
    """Parameters as the checkpoint stores them at `precision` (CPU copies)."""
    dt = stored_dtype(precision)
    return {n: p.detach().to(device="cpu", dtype=dt).clone() for n, p in model.named_parameters()}


# ---------------------------------------------------------------------------------------------
# Masks and the mask-aware optimizer
# ---------------------------------------------------------------------------------------------


def prepare_masked_params(
    model: torch.nn.Module, mask: Mapping[str, torch.Tensor] | None
) -> list[tuple[str, torch.nn.Parameter, torch.Tensor | None]]:
    """(name, param, float mask or None) for each parameter that will train.

    With a mask: names must be parameters of the model with matching shapes (ValueError naming the
    first mismatch); parameters absent from the mask or with an all-False mask are frozen by
    requires_grad = False; an all-True mask is stored as None (dense). Without a mask: all
    parameters, dense.
    """
    named = dict(model.named_parameters())
    if mask is None:
        for p in named.values():
            p.requires_grad_(True)
        return [(n, p, None) for n, p in named.items()]
    for n, m in mask.items():
        if n not in named:
            raise ValueError(f"mask: parameter {n!r} is not a parameter of the model")
        if tuple(m.shape) != tuple(named[n].shape):
            raise ValueError(
                f"mask: parameter {n!r} has shape {list(m.shape)} in the mask "
                f"but {list(named[n].shape)} in the model"
            )
    out = []
    for n, p in named.items():
        m = mask.get(n)
        if m is None or not bool(m.any()):
            p.requires_grad_(False)
            continue
        p.requires_grad_(True)
        mf = None if bool(m.all()) else m.to(device=p.device, dtype=p.dtype)
        out.append((n, p, mf))
    if not out:
        raise ValueError("mask: selects no coordinate of the model; nothing would train")
    return out


def mask_gradients(params: list[tuple[str, torch.nn.Parameter, torch.Tensor | None]]) -> None:
    """Zero the gradient off the mask, in place (call after backward, before clipping)."""
    for _, p, m in params:
        if m is not None and p.grad is not None:
            p.grad.mul_(m)


class MaskedOptimizer:
    """AdamW or SGD whose step never changes a masked-out coordinate (see the module docstring).

    AdamW matches torch.optim.AdamW (decoupled decay, bias correction) on the mask; SGD matches
    torch.optim.SGD (coupled decay, momentum buffer b = mu * b + g, no dampening).
    """

    def __init__(
        self,
        params: list[tuple[str, torch.nn.Parameter, torch.Tensor | None]],
        kind: str = "adamw",
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        momentum: float = 0.0,
    ):
        if kind not in OPTIMIZERS:
            raise ValueError(f"optimizer: got {kind!r}; accepted: {', '.join(OPTIMIZERS)}")
        self.params = params
        self.kind, self.lr, self.wd = kind, lr, weight_decay
        self.betas, self.eps, self.momentum = betas, eps, momentum
        self.t = 0
        self.state: dict[str, dict[str, torch.Tensor]] = {}

    def zero_grad(self) -> None:
        for _, p, _m in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        self.t += 1
        live = [(n, p, m) for n, p, m in self.params if p.grad is not None]
        full = [(n, p, m) for n, p, m in live if p.dtype == torch.float32]
        low = [(n, p, m) for n, p, m in live if p.dtype != torch.float32]
        if self.kind == "adamw":
            self._adamw_foreach(full)
        else:
            for name, p, m in full:
                g = p.grad if m is None else p.grad * m  # re-mask: the invariant holds even if
                self._sgd(name, p, g, m)  # the caller forgot mask_gradients
        # Low-precision weights (precision 'bf16'): float32 optimizer state and update, then the
        # weight is written back rounded, round(w - update): an update below half an ULP of w is
        # lost. Off the mask the update is exactly 0, and bf16 -> float32 -> bf16 is exact.
        for name, p, m in low:
            p32 = p.detach().float()
            m32 = None if m is None else m.float()
            g = p.grad.float() if m32 is None else p.grad.float() * m32
            if self.kind == "adamw":
                self._adamw(name, p32, g, m32)
            else:
                self._sgd(name, p32, g, m32)
            p.copy_(p32)

    def _adamw_foreach(self, live: list[tuple[str, torch.nn.Parameter, torch.Tensor | None]]) -> None:
        """AdamW over all tensors at once (torch._foreach_*), same maths as `_adamw`."""
        if not live:
            return
        for n, p, _m in live:
            if n not in self.state:
                self.state[n] = {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
        params = [p for _, p, _m in live]
        grads = [p.grad for _, p, _m in live]
        masked = [i for i, (_, _p, m) in enumerate(live) if m is not None]
        if masked:  # re-mask: the invariant holds even if the caller forgot mask_gradients
            gm = torch._foreach_mul([grads[i] for i in masked], [live[i][2] for i in masked])
            for i, g in zip(masked, gm, strict=True):
                grads[i] = g
        m1 = [self.state[n]["exp_avg"] for n, _p, _m in live]
        m2 = [self.state[n]["exp_avg_sq"] for n, _p, _m in live]
        b1, b2 = self.betas
        torch._foreach_mul_(m1, b1)
        torch._foreach_add_(m1, grads, alpha=1 - b1)
        torch._foreach_mul_(m2, b2)
        torch._foreach_addcmul_(m2, grads, grads, value=1 - b2)
        bc1 = 1 - b1**self.t
        bc2 = 1 - b2**self.t
        denom = torch._foreach_sqrt(m2)
        torch._foreach_div_(denom, math.sqrt(bc2))
        torch._foreach_add_(denom, self.eps)
        updates = torch._foreach_div(m1, denom)  # exactly 0 off the mask
        torch._foreach_mul_(updates, self.lr / bc1)
        if self.wd:
            dense = [i for i, (_, _p, m) in enumerate(live) if m is None]
            if dense:
                torch._foreach_add_([updates[i] for i in dense], [params[i] for i in dense],
                                    alpha=self.lr * self.wd)
            if masked:  # decoupled decay only on the mask
                torch._foreach_addcmul_([updates[i] for i in masked], [params[i] for i in masked],
                                        [live[i][2] for i in masked], value=self.lr * self.wd)
        torch._foreach_sub_(params, updates)

    def _adamw(self, name: str, p: torch.Tensor, g: torch.Tensor, m: torch.Tensor | None) -> None:
        st = self.state.get(name)
        if st is None:
            st = self.state[name] = {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
        b1, b2 = self.betas
        st["exp_avg"].mul_(b1).add_(g, alpha=1 - b1)
        st["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
        bc1 = 1 - b1**self.t
        bc2 = 1 - b2**self.t
        denom = (st["exp_avg_sq"].sqrt() / math.sqrt(bc2)).add_(self.eps)
        update = st["exp_avg"] / denom * (self.lr / bc1)  # exactly 0 off the mask
        if self.wd:
            if m is None:
                update.add_(p, alpha=self.lr * self.wd)
            else:
                update.addcmul_(p, m, value=self.lr * self.wd)
        p.sub_(update)

    def _sgd(self, name: str, p: torch.Tensor, g: torch.Tensor, m: torch.Tensor | None) -> None:
        if self.wd:
            g = g.add(p if m is None else p * m, alpha=self.wd)
        if self.momentum:
            st = self.state.get(name)
            if st is None:
                st = self.state[name] = {"momentum": g.clone()}
            else:
                st["momentum"].mul_(self.momentum).add_(g)
            g = st["momentum"]
        p.sub_(g * self.lr)


def clip_grad_norm(
    params: list[tuple[str, torch.nn.Parameter, torch.Tensor | None]], max_norm: float | None
) -> float:
    """Global L2 norm of the (already masked) gradients; scaled down to max_norm if above."""
    grads = [p.grad for _, p, _m in params if p.grad is not None]
    if not grads:
        return 0.0
    norm = torch.linalg.vector_norm(torch.stack([n.float() for n in torch._foreach_norm(grads)]))
    if max_norm is not None:
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_(grads, scale.to(grads[0].dtype))
    return float(norm)


# ---------------------------------------------------------------------------------------------
# Log-probs of a rollout (with the logits when OPD needs them)
# ---------------------------------------------------------------------------------------------


def rollout_logprobs(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
    with_logits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs (N, L-1) of tokens 1..L-1 given their prefix, and optionally the
    float32 logits (N, L-1, V) that predicted them. Differentiable."""
    pos = (attention_mask.long().cumsum(1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=pos).logits
    logits = logits[:, :-1].float()  # (N, L-1, V)
    lp = logits.log_softmax(-1).gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)  # (N, L-1)
    return lp, (logits if with_logits else None)


# ---------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------


@dataclass
class TrainResult:
    curve: list[dict[str, float]]  # one row per step: reward, loss, grad_norm, ... (+ accuracy)
    accuracy_before: float
    accuracy_after: float
    settings: dict[str, Any]
    seconds: float
    trainable_fraction: float
    updates: int = 0  # optimizer updates taken (steps x inner steps, minus skipped steps)
    # with config.track_gradients: per coordinate sum over updates of g^2 and of |g|, where g is
    # the masked, unclipped gradient of the training loss (float32, CPU)
    grad_sq_sum: dict[str, torch.Tensor] | None = None
    grad_abs_sum: dict[str, torch.Tensor] | None = None


def _rewards(task: Any, completions: list[str], answers: list[str]) -> torch.Tensor:
    return torch.tensor([float(task.reward(c, a)) for c, a in zip(completions, answers, strict=True)])


def train(
    model: torch.nn.Module,
    tokenizer: Any,
    task: Any,
    config: TrainConfig,
    mask: Mapping[str, torch.Tensor] | None = None,
    teacher: torch.nn.Module | None = None,
    teacher_tokenizer: Any = None,
    progress: Callable[[float, str], None] | None = None,
    evaluate: bool = True,
    grad_hook: Callable[[int, list[tuple[str, torch.nn.Parameter, torch.Tensor | None]]], None]
    | None = None,
) -> TrainResult:
    """Train `model` in place on `task` with one algorithm; returns the curves and accuracies.

    Prompts of step s are train-split items s*batch .. (s+1)*batch-1 of task.examples(seed=seed);
    sampling is seeded by (seed, step), so a masked and a full run with the same config see the
    same prompts and (until the policies diverge) the same random numbers.
    grad_hook(step, params) sees the masked, unclipped gradients before each optimizer step.
    """
    from compute.models import greedy_accuracy
    from compute.sampling import build_rollout, sample_completions

    progress = progress or (lambda f, m="": None)
    torch.manual_seed(config.seed)
    if config.algo == "opd":
        if teacher is None:
            raise ValueError("teacher: on-policy distillation (algo 'opd') needs a teacher model")
        if teacher_tokenizer is not None:
            check_same_tokenizer(tokenizer, teacher_tokenizer)
        teacher.eval()
        for p in teacher.parameters():
            p.requires_grad_(False)
    prepare_precision(model, config.precision)
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    params = prepare_masked_params(model, mask)
    grad_sq: dict[str, torch.Tensor] | None = None
    grad_abs: dict[str, torch.Tensor] | None = None
    if config.track_gradients:  # one float32 buffer each, for every parameter (frozen ones stay 0)
        grad_sq = {n: torch.zeros(p.shape, dtype=torch.float32, device=p.device)
                   for n, p in model.named_parameters()}
        grad_abs = {n: torch.zeros_like(t) for n, t in grad_sq.items()}
    n_updates = 0
    n_total = sum(p.numel() for p in model.parameters())
    n_train = sum(int(m.sum()) if m is not None else p.numel() for _, p, m in params)
    ref = None
    if config.algo == "grpo" and config.kl_coef > 0:
        ref = copy.deepcopy(model).eval()
        for p in ref.parameters():
            p.requires_grad_(False)
    opt = MaskedOptimizer(
        params, config.optimizer, config.lr, config.weight_decay,
        (config.beta1, config.beta2), config.adam_eps, config.momentum,
    )

    def acc() -> float:
        return greedy_accuracy(model, tokenizer, task, n=config.eval_prompts, split="test",
                               seed=0, max_new_tokens=config.eval_max_new_tokens)

    t0 = time.perf_counter()
    before = acc() if evaluate else float("nan")
    curve: list[dict[str, float]] = []
    for step in range(config.steps):
        examples = task.examples(config.batch, seed=config.seed, split="train", start=step * config.batch)
        prompts = [e.prompt for e in examples]
        answers = [e.answer for e in examples]
        row: dict[str, float] = {"step": step + 1}
        step_seed = config.seed * 1_000_003 + step
        model.train()
        if config.algo == "sft" and config.sft_source == "gold":
            roll = build_rollout(tokenizer, prompts, answers, device=next(model.parameters()).device)
            rewards = torch.ones(len(prompts))
        else:
            roll = sample_completions(
                model, tokenizer, prompts, samples=config.group,
                max_new_tokens=config.max_new_tokens, temperature=config.temperature, seed=step_seed,
            )
            rewards = _rewards(task, roll.completions, [answers[i] for i in roll.prompt_index.tolist()])
            row["reward"] = float(rewards.mean())
        ids, am = roll.input_ids, roll.attention_mask
        cmask = roll.completion_mask[:, 1:]  # (N, L-1): aligned with rollout_logprobs
        stats: dict[str, float] = {}
        updates = config.inner_steps if config.algo == "grpo" else 1
        old_lp = ref_lp = None
        if config.algo == "grpo":
            adv = group_advantages(rewards, roll.prompt_index.cpu(), config.scale_std).to(ids.device)
            if updates > 1:
                with torch.no_grad():
                    old_lp, _ = rollout_logprobs(model, ids, am)
            if ref is not None:
                with torch.no_grad():
                    ref_lp, _ = rollout_logprobs(ref, ids, am)
        if config.algo == "sft" and config.sft_source == "self":
            keep = keep_rewarded(rewards)
            row["kept"] = float(len(keep))
            if len(keep) == 0:
                curve.append(row)
                progress((step + 1) / config.steps, f"step {step + 1}/{config.steps}: no rewarded sample")
                continue
            roll = roll.select(keep)
            ids, am, cmask = roll.input_ids, roll.attention_mask, roll.completion_mask[:, 1:]
        t_logits = t_lp = None
        if config.algo == "opd":
            with torch.no_grad():
                t_lp, t_logits = rollout_logprobs(
                    teacher, ids, am, with_logits=config.distill_estimator == "full"
                )
        for _ in range(updates):
            opt.zero_grad()
            need_logits = config.algo == "opd" and config.distill_estimator == "full"
            lp, logits = rollout_logprobs(model, ids, am, with_logits=need_logits)
            if config.algo == "grpo":
                loss, stats = grpo_loss(
                    lp, old_lp if old_lp is not None else lp.detach(), adv, cmask,
                    config.clip_eps, ref_lp, config.kl_coef, config.aggregation,
                )
            elif config.algo == "opd":
                if logits is not None and t_logits is not None and logits.shape[-1] != t_logits.shape[-1]:
                    v = min(logits.shape[-1], t_logits.shape[-1])  # padded vocab rows carry no tokens
                    logits, t_logits = logits[..., :v], t_logits[..., :v]
                loss, stats = distill_loss(
                    lp, t_lp, cmask, config.distill_estimator, logits, t_logits, config.aggregation
                )
            else:
                loss = sft_loss(lp, cmask, config.aggregation)
            loss.backward()
            mask_gradients(params)
            if grad_sq is not None and grad_abs is not None:
                with torch.no_grad():
                    for n, p, _m in params:
                        if p.grad is not None:
                            g = p.grad.detach().float()
                            grad_sq[n].addcmul_(g, g)
                            grad_abs[n].add_(g.abs())
            n_updates += 1
            if grad_hook is not None:
                grad_hook(step, params)
            row["grad_norm"] = clip_grad_norm(params, config.grad_clip)
            opt.step()
        row["loss"] = float(loss.detach())
        row.update({k: float(v) for k, v in stats.items()})
        if config.eval_every and (step + 1) % config.eval_every == 0 and step + 1 < config.steps:
            row["accuracy"] = acc()
        curve.append(row)
        msg = f"step {step + 1}/{config.steps}" + (f" reward {row['reward']:.3f}" if "reward" in row else "")
        progress((step + 1) / config.steps, msg)
    model.eval()
    after = acc() if evaluate else float("nan")
    for n, p in model.named_parameters():
        p.requires_grad_(flags[n])
    settings = asdict(config)
    settings["masked"] = mask is not None
    settings["compute_dtype"] = "bfloat16" if config.precision == "bf16" else "float32"
    settings["stored_dtype"] = str(stored_dtype(config.precision)).replace("torch.", "")
    settings["optimizer_state_dtype"] = "float32"
    res = TrainResult(curve, before, after, settings, time.perf_counter() - t0, n_train / max(1, n_total))
    res.updates = n_updates
    if grad_sq is not None and grad_abs is not None:
        res.grad_sq_sum = {n: t.cpu() for n, t in grad_sq.items()}
        res.grad_abs_sum = {n: t.cpu() for n, t in grad_abs.items()}
    return res


def save_output(
    model: torch.nn.Module, tokenizer: Any, out_dir: str | Path, metrics: Mapping[str, Any],
    precision: str = "fp32",
) -> Path:
    """Write the trained model + tokenizer (HF format) and metrics.json into out_dir.

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


def objective_gradient(
    model: torch.nn.Module, tokenizer: Any, task: Any, config: TrainConfig,
    teacher: torch.nn.Module | None = None,
) -> dict[str, torch.Tensor]:
    """|gradient| (float32, CPU) of the training objective on the first batch at the start
    (for the 'gradient' mask selector). The model is not changed (a copy takes the step)."""
    captured: dict[str, torch.Tensor] = {}

    def hook(step: int, params: list[tuple[str, torch.nn.Parameter, torch.Tensor | None]]) -> None:
        if step == 0 and not captured:
            for n, p, _m in params:
                g = p.grad
                captured[n] = (g.detach().abs().float().cpu() if g is not None
                               else torch.zeros(p.shape, dtype=torch.float32))

    cfg = TrainConfig(**{**asdict(config), "steps": 1})
    train(copy.deepcopy(model), tokenizer, task, cfg, teacher=teacher, evaluate=False, grad_hook=hook)
    return captured
