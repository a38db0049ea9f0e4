"""GRPO objective: sample a group per prompt, group-normalised advantages, clipped surrogate with
an optional k3 KL to the frozen initial policy (maths in compute.grpo)."""

from __future__ import annotations

import copy
from typing import Any

import torch

from compute.grpo import group_advantages, grpo_loss
from compute.train.objectives.base import Batch, frozen, policy_logprobs, sampled_rollout


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
