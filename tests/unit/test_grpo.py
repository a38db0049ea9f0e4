"""GRPO maths against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from compute.train import TrainConfig
from compute.train.objectives.base import aggregate
from compute.train.objectives.grpo import group_advantages, grpo_loss, k3_kl


def test_group_advantages_hand_values() -> None:
    r = torch.tensor([1.0, 0, 0, 1, 1, 1, 1, 0])
    g = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    # group 0: mean .5, unbiased std sqrt(1/3); group 1: mean .75, std .5
    a = group_advantages(r, g, scale_std=True, eps=0.0)
    s = 0.5 / math.sqrt(1 / 3)
    assert_close(a, torch.tensor([s, -s, -s, s, 0.5, 0.5, 0.5, -1.5]))
    assert_close(group_advantages(r, g, scale_std=False), torch.tensor([.5, -.5, -.5, .5, .25, .25, .25, -.75]))


def test_group_advantages_interleaved_groups_and_constant_group() -> None:
    r = torch.tensor([1.0, 2.0, 3.0, 2.0])
    g = torch.tensor([5, 1, 5, 1])  # any labels, any order
    a = group_advantages(r, g, eps=0.0, scale_std=False)
    assert_close(a, torch.tensor([-1.0, 0.0, 1.0, 0.0]))
    # a constant group has zero advantage (no division blow-up thanks to eps)
    a2 = group_advantages(torch.tensor([1.0, 1.0]), torch.tensor([0, 0]))
    assert_close(a2, torch.zeros(2))


def test_clipped_loss_hand_values() -> None:
    logp = torch.log(torch.tensor([[0.5, 0.25], [0.8, 1.0]]))
    old = torch.log(torch.tensor([[0.4, 0.25], [0.5, 1.0]]))
    mask = torch.tensor([[True, True], [True, False]])
    adv = torch.tensor([1.0, -1.0])
    # ratios 1.25, 1.0 | 1.6: seq0 A=+1 -> -min(1.25, 1.2) = -1.2, -1; seq1 A=-1 -> -min(-1.6,-1.2)=1.6
    loss, stats = grpo_loss(logp, old, adv, mask, clip_eps=0.2, aggregation="token")
    assert_close(loss, torch.tensor((-1.2 - 1.0 + 1.6) / 3))
    assert stats["clip_frac"] == pytest.approx(1 / 3)  # only the 1.25 token is clipped
    loss_s, _ = grpo_loss(logp, old, adv, mask, clip_eps=0.2, aggregation="sequence")
    assert_close(loss_s, torch.tensor((-2.2 / 2 + 1.6) / 2))


def test_on_policy_gradient_is_advantage_times_score() -> None:
    logp = torch.log(torch.tensor([[0.5, 0.25, 0.9], [0.8, 0.3, 0.6]])).requires_grad_(True)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    adv = torch.tensor([2.0, -0.5])
    loss, _ = grpo_loss(logp, logp.detach(), adv, mask, aggregation="token")
    loss.backward()
    expected = -adv[:, None] * mask.float() / 5
    assert_close(logp.grad, expected)


def test_k3_kl_hand_value_and_in_loss() -> None:
    lp = torch.log(torch.tensor([[0.5]]))
    ref = torch.log(torch.tensor([[0.25]]))
    kl = k3_kl(lp, ref)
    assert_close(kl, torch.tensor([[0.5 + math.log(2) - 1]]))
    loss, stats = grpo_loss(lp, lp, torch.tensor([0.0]), torch.tensor([[True]]), ref_logp=ref, kl_coef=2.0)
    assert_close(loss, 2 * kl[0, 0])
    assert stats["kl"] == pytest.approx(float(kl))
    assert_close(k3_kl(lp, lp), torch.zeros(1, 1))


def test_aggregate_sequence_skips_empty_rows() -> None:
    x = torch.tensor([[1.0, 3.0], [5.0, 7.0]])
    m = torch.tensor([[True, True], [False, False]])
    assert_close(aggregate(x, m, "sequence"), torch.tensor(2.0))
    with pytest.raises(ValueError, match="aggregation"):
        aggregate(x, m, "bogus")


@pytest.mark.parametrize("kw,field", [({"group": 1}, "group"), ({"clip_eps": 0}, "clip_eps"),
                                      ({"kl_coef": -1}, "kl_coef"), ({"aggregation": "x"}, "aggregation"),
                                      ({"inner_steps": 0}, "inner_steps")])
def test_config_validation(kw: dict, field: str) -> None:
    """GRPO's knobs are TrainSpec fields: the training config refuses what the spec refuses."""
    with pytest.raises(ValueError, match=f"^{field}:"):
        TrainConfig(algo="grpo", **kw)
