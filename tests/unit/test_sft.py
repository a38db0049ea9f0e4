"""SFT maths."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from compute.train import TrainConfig
from compute.train.objectives.sft import keep_rewarded, sft_loss


def test_sft_nll_hand_value() -> None:
    lp = torch.log(torch.tensor([[0.5, 0.25], [0.1, 0.9]]))
    m = torch.tensor([[True, True], [False, True]])
    assert_close(sft_loss(lp, m), torch.tensor((math.log(2) + math.log(4) - math.log(0.9)) / 3))
    assert_close(sft_loss(lp, m, "sequence"), torch.tensor(((math.log(2) + math.log(4)) / 2 - math.log(0.9)) / 2))


def test_keep_rewarded() -> None:
    assert keep_rewarded(torch.tensor([0.0, 1.0, 1.0, 0.0])).tolist() == [1, 2]
    assert keep_rewarded(torch.zeros(3)).numel() == 0


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="^sft_source: got 'teacher'; accepted: gold, self"):
        TrainConfig(algo="sft", sft_source="teacher")
