"""SFT objective: NLL of the gold answers, or of the model's own samples that earned reward 1
(near-policy SFT; maths in compute.sft)."""

from __future__ import annotations

from typing import Any

import torch

from compute.sft import keep_rewarded, sft_loss
from compute.train.objectives.base import Batch, gold_rollout, policy_logprobs, sampled_rollout


class SFT:
    updates = 1

    def __init__(self, config: Any, model: torch.nn.Module, tokenizer: Any, task: Any, **_: Any):
        self.config, self.tokenizer, self.task = config, tokenizer, task

    def make_batch(self, model: torch.nn.Module, step: int) -> Batch:
        if self.config.sft_source == "gold":
            return Batch.of(gold_rollout(model, self.tokenizer, self.task, self.config, step))
        roll, rewards = sampled_rollout(model, self.tokenizer, self.task, self.config, step)
        keep = keep_rewarded(rewards)
        return Batch.of(roll.select(keep), {"reward": float(rewards.mean()), "kept": float(len(keep))})

    def loss(self, model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        lp, _ = policy_logprobs(model, batch)
        return sft_loss(lp, batch.completion_mask, self.config.aggregation), {}
