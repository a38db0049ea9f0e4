"""SFT: negative log-likelihood of completions, on gold answers or on the model's own samples
filtered to reward 1 (near-policy SFT: its gradient is E_y[1{r(y)=1} grad log p(y)], the form of
docs/science.md section 3 with A = reward). The maths and the objective."""

from __future__ import annotations

from typing import Any

import torch

from compute.train.objectives.base import (
    Batch,
    aggregate,
    gold_rollout,
    policy_logprobs,
    sampled_rollout,
)


def sft_loss(logp: torch.Tensor, mask: torch.Tensor, aggregation: str = "token") -> torch.Tensor:
    """Mean negative log-likelihood of the completion tokens. logp, mask: (N, T)."""
    return aggregate(-logp, mask, aggregation)


def keep_rewarded(rewards: torch.Tensor, threshold: float = 1.0) -> torch.Tensor:
    """Indices (K,) of samples whose reward >= threshold (near-policy SFT filter). rewards: (N,)."""
    return torch.nonzero(rewards >= threshold, as_tuple=False).flatten()


class SFT:
    updates = 1

    def __init__(self, config: Any, model: torch.nn.Module, tokenizer: Any, task: Any, **_: Any):
        self.config, self.tokenizer, self.task = config, tokenizer, task

    def make_batch(self, model: torch.nn.Module, step: int) -> Batch:
        if self.config.sft_source == "gold":
            return Batch.of(gold_rollout(model, self.tokenizer, self.task, self.config, step))
        roll, rewards = sampled_rollout(model, self.tokenizer, self.task, self.config, step)
        keep = keep_rewarded(rewards)
        return Batch.of(roll.select(keep), {"reward": float(rewards.mean()), "kept": float(len(keep))},
                        sampled=roll.lengths)

    def loss(self, model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        lp, _ = policy_logprobs(model, batch)
        return sft_loss(lp, batch.completion_mask, self.config.aggregation), {}
