"""SFT maths: negative log-likelihood of completions, on gold answers or on the model's own
samples filtered to reward 1 (near-policy SFT: its gradient is E_y[1{r(y)=1} grad log p(y)], the
form of SCIENCE.md section 3 with A = reward)."""

from __future__ import annotations

import torch

from compute.grpo import aggregate


def sft_loss(logp: torch.Tensor, mask: torch.Tensor, aggregation: str = "token") -> torch.Tensor:
    """Mean negative log-likelihood of the completion tokens. logp, mask: (N, T)."""
    return aggregate(-logp, mask, aggregation)


def keep_rewarded(rewards: torch.Tensor, threshold: float = 1.0) -> torch.Tensor:
    """Indices (K,) of samples whose reward >= threshold (near-policy SFT filter). rewards: (N,)."""
    return torch.nonzero(rewards >= threshold, as_tuple=False).flatten()
