"""What every training objective shares: the batch it builds for one step and the policy's
per-token log-probs on it. An objective is an object with

    updates: int                                  optimizer updates per batch
    make_batch(model, step) -> Batch              prompts of `step`, rollouts, rewards (no grad)
    loss(model, batch) -> (loss, metrics)         the differentiable loss of one update

and compute.train.loop runs any of them the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from compute.lm.sampling import Rollout, build_rollout, sample_completions, token_logprobs

AGGREGATIONS = ("token", "sequence")  # how a per-token loss is reduced (aggregate)


@dataclass
class Batch:
    """One step's rows. input_ids, attention_mask: (N, L); completion_mask: (N, L-1) bool, the
    tokens whose log-prob counts (aligned with `policy_logprobs`); metrics: recorded in the step's
    curve row (reward, kept, ...); extra: what the objective's loss needs (advantages, teacher
    log-probs, ...). N may be 0 (nothing to train on this step: the update is skipped)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    completion_mask: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    # the step's sampled completions as sampled, (tokens generated, ended) per row, all of them
    # (near-policy SFT keeps some): what the run records of how long they ran (None: gold rows)
    sampled: list[tuple[int, bool]] | None = None

    @classmethod
    def of(cls, roll: Rollout, metrics: dict[str, float] | None = None, *,
           sampled: list[tuple[int, bool]] | None = None, **extra: Any) -> Batch:
        return cls(roll.input_ids, roll.attention_mask, roll.completion_mask[:, 1:], metrics or {}, extra,
                   sampled if sampled is not None else roll.lengths)

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


class Objective(Protocol):
    updates: int

    def make_batch(self, model: torch.nn.Module, step: int) -> Batch: ...

    def loss(self, model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]: ...


def policy_logprobs(
    model: torch.nn.Module, batch: Batch, with_logits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs (N, L-1) of tokens 1..L-1, and with_logits the float32 logits
    (N, L-1, V) that predicted them. Differentiable."""
    if with_logits:
        lp, logits = token_logprobs(model, batch.input_ids, batch.attention_mask, return_logits=True)
        return lp[:, 1:], logits
    return token_logprobs(model, batch.input_ids, batch.attention_mask)[:, 1:], None


def frozen(model: torch.nn.Module) -> torch.nn.Module:
    """`model` in eval mode with no parameter requiring grad (a reference or a teacher)."""
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def step_examples(task: Any, config: Any, step: int) -> tuple[list[str], list[str]]:
    """Prompts and answers of `step`: train-split items step*batch .. (step+1)*batch-1."""
    examples = task.examples(config.batch, seed=config.seed, split="train", start=step * config.batch)
    return [e.prompt for e in examples], [e.answer for e in examples]


def step_seed(config: Any, step: int) -> int:
    """Sampling seed of `step`: a masked and a full run with the same seed draw the same numbers."""
    return config.seed * 1_000_003 + step


def sampled_rollout(
    model: torch.nn.Module, tokenizer: Any, task: Any, config: Any, step: int,
) -> tuple[Rollout, torch.Tensor]:
    """`config.group` on-policy completions per prompt of `step`, and their (N,) task rewards."""
    prompts, answers = step_examples(task, config, step)
    roll = sample_completions(model, tokenizer, prompts, samples=config.group,
                              max_new_tokens=config.max_new_tokens, temperature=config.temperature,
                              seed=step_seed(config, step))
    rewards = torch.tensor([float(task.reward(c, answers[i]))
                            for c, i in zip(roll.completions, roll.prompt_index.tolist(), strict=True)])
    return roll, rewards


def gold_rollout(model: torch.nn.Module, tokenizer: Any, task: Any, config: Any, step: int) -> Rollout:
    """The task's gold answers to the prompts of `step`, one row each."""
    prompts, answers = step_examples(task, config, step)
    return build_rollout(tokenizer, prompts, answers, device=next(model.parameters()).device)


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, aggregation: str = "token") -> torch.Tensor:
    """Reduce a (N, T) per-token loss over the (N, T) bool mask to a scalar.

    'token': sum / number of masked tokens; 'sequence': mean over sequences with at least one token
    of (sequence sum / sequence length).
    """
    m = mask.to(per_token.dtype)
    if aggregation == "token":
        return (per_token * m).sum() / m.sum().clamp(min=1)
    if aggregation == "sequence":
        lengths = m.sum(dim=1)  # (N,)
        keep = lengths > 0
        per_seq = (per_token * m).sum(dim=1)[keep] / lengths[keep]
        return per_seq.mean() if keep.any() else per_token.sum() * 0
    raise ValueError(f"aggregation: got {aggregation!r}; accepted: {', '.join(AGGREGATIONS)}")
