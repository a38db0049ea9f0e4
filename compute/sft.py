"""SFT maths: negative log-likelihood of completions, on gold answers or on the model's own
samples filtered to reward 1 (near-policy SFT: its gradient is E_y[1{r(y)=1} grad log p(y)], the
form of SCIENCE.md section 3 with A = reward)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from compute.grpo import AGGREGATIONS, aggregate

SOURCES = ("gold", "self")


@dataclass
class SFTConfig:
    source: str = field(
        default="gold",
        metadata={"help": "'gold': the task's answers; 'self': the model's own samples with reward 1"},
    )
    samples: int = field(default=4, metadata={"help": "'self': completions sampled per prompt"})
    aggregation: str = field(default="token", metadata={"help": "'token' or 'sequence' mean of the NLL"})
    temperature: float = field(default=1.0, metadata={"help": "'self': sampling temperature"})

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"source: got {self.source!r}; accepted: {', '.join(SOURCES)}")
        if self.samples < 1:
            raise ValueError(f"samples: got {self.samples}; must be >= 1")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation: got {self.aggregation!r}; accepted: {', '.join(AGGREGATIONS)}")
        if not self.temperature > 0:
            raise ValueError(f"temperature: got {self.temperature}; must be > 0")


def sft_loss(logp: torch.Tensor, mask: torch.Tensor, aggregation: str = "token") -> torch.Tensor:
    """Mean negative log-likelihood of the completion tokens. logp, mask: (N, T)."""
    return aggregate(-logp, mask, aggregation)


def keep_rewarded(rewards: torch.Tensor, threshold: float = 1.0) -> torch.Tensor:
    """Indices (K,) of samples whose reward >= threshold (near-policy SFT filter). rewards: (N,)."""
    return torch.nonzero(rewards >= threshold, as_tuple=False).flatten()
