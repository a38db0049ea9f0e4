"""GRPO: sample a group per prompt, group-normalised advantages, clipped surrogate with an
optional k3 KL to the frozen initial policy. The maths (free functions on tensors) and the
objective that builds the batches; `compute.train` runs the optimizer. Knobs (group, clip_eps,
kl_coef, ...) are TrainSpec fields.

For prompt x with G sampled completions y_1..y_G and rewards r_j:

    A_j = (r_j - mean_g r) / (std_g r + eps)           (or r_j - mean_g r with scale_std=False)
    ratio_t = exp(log p(y_t) - log p_old(y_t))
    loss_t  = -min(ratio_t * A, clip(ratio_t, 1 - e, 1 + e) * A) + beta * KL_t
    KL_t    = exp(ref_t - logp_t) - (ref_t - logp_t) - 1   (k3 estimator, >= 0, unbiased)

With one optimizer update per batch (the default) p_old = p, the ratio is 1 and the gradient is
the plain policy gradient A * grad log p(y_t), the form of docs/science.md section 3.
The std is the unbiased sample std within each group (as TRL does); recorded in the settings.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from compute.train.objectives.base import Batch, aggregate, frozen, policy_logprobs, sampled_rollout


def group_advantages(
    rewards: torch.Tensor, group_index: torch.Tensor, scale_std: bool = True, eps: float = 1e-4
) -> torch.Tensor:
    """Advantages normalised within each group.

    rewards: (N,) float; group_index: (N,) long, the prompt each completion belongs to.
    Returns (N,) float32: (r - mean_group) / (std_group + eps), std unbiased (0 for a group of 1).
    """
    rewards = rewards.float()
    groups, inverse = torch.unique(group_index, return_inverse=True)
    k = len(groups)
    count = torch.zeros(k, dtype=torch.float32, device=rewards.device).index_add_(
        0, inverse, torch.ones_like(rewards)
    )
    total = torch.zeros(k, dtype=torch.float32, device=rewards.device).index_add_(0, inverse, rewards)
    mean = total / count  # (k,)
    centred = rewards - mean[inverse]  # (N,)
    if not scale_std:
        return centred
    ss = torch.zeros(k, dtype=torch.float32, device=rewards.device).index_add_(0, inverse, centred**2)
    std = torch.sqrt(ss / (count - 1).clamp(min=1))  # (k,) unbiased
    return centred / (std[inverse] + eps)


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(p || ref) from tokens sampled from p: e^(r-l) - (r-l) - 1."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float = 0.2,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    aggregation: str = "token",
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped GRPO surrogate loss (to minimise).

    logp, old_logp, ref_logp: (N, T) per-token log-probs of the sampled tokens (logp carries grad);
    advantages: (N,) one per completion; mask: (N, T) bool, the completion tokens.
    Returns (scalar loss, stats: clip fraction, mean kl, mean ratio).
    """
    ratio = torch.exp(logp - old_logp.detach())  # (N, T)
    adv = advantages.detach()[:, None].to(logp.dtype)  # (N, 1)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * adv
    per_token = -torch.minimum(unclipped, clipped)  # (N, T)
    kl_mean = 0.0
    if ref_logp is not None and kl_coef > 0:
        kl = k3_kl(logp, ref_logp.detach())
        per_token = per_token + kl_coef * kl
        kl_mean = float(aggregate(kl.detach(), mask, "token"))
    loss = aggregate(per_token, mask, aggregation)
    with torch.no_grad():
        # the clipped branch is the active one (its gradient is zero)
        was_clipped = (((ratio > 1 + clip_eps) & (adv > 0)) | ((ratio < 1 - clip_eps) & (adv < 0))).float()
        stats = {
            "clip_frac": float(aggregate(was_clipped, mask, "token")),
            "kl": kl_mean,
            "ratio": float(aggregate(ratio.detach(), mask, "token")),
        }
    return loss, stats


class GRPO:
    def __init__(self, config: Any, model: torch.nn.Module, tokenizer: Any, task: Any, **_: Any):
        self.config, self.tokenizer, self.task = config, tokenizer, task
        self.updates = config.inner_steps
        # the reference is the policy before training (a copy, taken when the objective is made)
        self.ref = frozen(copy.deepcopy(model)) if config.kl_coef > 0 else None

    def make_batch(self, model: torch.nn.Module, step: int) -> Batch:
        c = self.config
        roll, rewards = sampled_rollout(model, self.tokenizer, self.task, c, step)
        batch = Batch.of(roll, {"reward": float(rewards.mean())})
        batch.extra["advantages"] = group_advantages(rewards, roll.prompt_index.cpu(), c.scale_std).to(
            roll.input_ids.device)
        with torch.no_grad():
            # with one update per batch the old policy is the current one (ratio 1)
            batch.extra["old_lp"] = policy_logprobs(model, batch)[0] if self.updates > 1 else None
            batch.extra["ref_lp"] = policy_logprobs(self.ref, batch)[0] if self.ref is not None else None
        return batch

    def loss(self, model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        c, x = self.config, batch.extra
        lp, _ = policy_logprobs(model, batch)
        old = x["old_lp"] if x["old_lp"] is not None else lp.detach()
        return grpo_loss(lp, old, x["advantages"], batch.completion_mask, c.clip_eps, x["ref_lp"],
                         c.kl_coef, c.aggregation)
