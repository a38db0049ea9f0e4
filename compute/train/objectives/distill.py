"""On-policy distillation objective: the student samples, the teacher scores the same tokens,
reverse KL(student || teacher) per token (maths in compute.distill)."""

from __future__ import annotations

from typing import Any

import torch

from compute.distill import check_same_tokenizer, distill_loss
from compute.train.objectives.base import Batch, frozen, policy_logprobs, sampled_rollout


class Distill:
    updates = 1

    def __init__(self, config: Any, model: torch.nn.Module, tokenizer: Any, task: Any,
                 teacher: torch.nn.Module | None = None, teacher_tokenizer: Any = None, **_: Any):
        if teacher is None:
            raise ValueError("teacher: on-policy distillation (algo 'opd') needs a teacher model")
        if teacher_tokenizer is not None:
            check_same_tokenizer(tokenizer, teacher_tokenizer)
        self.config, self.tokenizer, self.task = config, tokenizer, task
        self.teacher = frozen(teacher)
        self.full = config.distill_estimator == "full"

    def make_batch(self, model: torch.nn.Module, step: int) -> Batch:
        roll, rewards = sampled_rollout(model, self.tokenizer, self.task, self.config, step)
        batch = Batch.of(roll, {"reward": float(rewards.mean())})
        with torch.no_grad():
            batch.extra["t_lp"], batch.extra["t_logits"] = policy_logprobs(self.teacher, batch, self.full)
        return batch

    def loss(self, model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        lp, logits = policy_logprobs(model, batch, self.full)
        t_logits = batch.extra["t_logits"]
        if logits is not None and t_logits is not None and logits.shape[-1] != t_logits.shape[-1]:
            v = min(logits.shape[-1], t_logits.shape[-1])  # padded vocab rows carry no tokens
            logits, t_logits = logits[..., :v], t_logits[..., :v]
        return distill_loss(lp, batch.extra["t_lp"], batch.completion_mask, self.config.distill_estimator,
                            logits, t_logits, self.config.aggregation)
