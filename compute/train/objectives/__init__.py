"""One objective per algorithm (make_batch, loss); `make_objective` picks it by config.algo."""

from __future__ import annotations

from typing import Any

import torch

from compute.train.objectives.base import Batch, Objective
from compute.train.objectives.distill import Distill
from compute.train.objectives.grpo import GRPO
from compute.train.objectives.sft import SFT

OBJECTIVES: dict[str, type] = {"grpo": GRPO, "opd": Distill, "sft": SFT}


def make_objective(config: Any, model: torch.nn.Module, tokenizer: Any, task: Any,
                   teacher: torch.nn.Module | None = None, teacher_tokenizer: Any = None) -> Objective:
    """The objective of config.algo (one of TrainSpec's algos) for `model`."""
    return OBJECTIVES[config.algo](config, model, tokenizer, task, teacher=teacher,
                                   teacher_tokenizer=teacher_tokenizer)


__all__ = ["OBJECTIVES", "Batch", "Distill", "GRPO", "Objective", "SFT", "make_objective"]
