"""On-policy distillation maths against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from compute.train import TrainConfig
from compute.train.objectives.distill import check_same_tokenizer, distill_loss, reverse_kl_full


def test_full_reverse_kl_hand_value() -> None:
    s = torch.tensor([[[0.0, 0.0]]])  # p_s = (.5, .5)
    t = torch.log(torch.tensor([[[0.25, 0.75]]]))
    kl = reverse_kl_full(s, t)
    expected = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    assert_close(kl, torch.tensor([[expected]]))
    assert_close(reverse_kl_full(t, t), torch.zeros(1, 1))


def test_full_reverse_kl_gradient_matches_closed_form() -> None:
    # d KL(p||q) / d z_v = p_v (log p_v - log q_v - KL)
    z = torch.tensor([[[0.3, -1.0, 0.5]]], requires_grad=True)
    q = torch.log(torch.tensor([[[0.2, 0.3, 0.5]]]))
    mask = torch.tensor([[True]])
    loss, stats = distill_loss(torch.zeros(1, 1), q[..., 0], mask, "full", z, q)
    loss.backward()
    p = torch.softmax(z.detach(), -1)
    kl = (p * (p.log() - q)).sum()
    assert_close(z.grad, p * (p.log() - q - kl))
    assert stats["reverse_kl_full"] == pytest.approx(float(kl), rel=1e-5)


def test_sampled_estimate_value_and_policy_gradient() -> None:
    ls = torch.log(torch.tensor([[0.5, 0.2]])).requires_grad_(True)
    lt = torch.log(torch.tensor([[0.25, 0.4]]))
    mask = torch.tensor([[True, True]])
    loss, stats = distill_loss(ls, lt, mask, "sampled")
    cost = torch.tensor([[math.log(2.0), math.log(0.5)]])  # log p_s - log p_t per token
    assert stats["reverse_kl"] == pytest.approx(float(cost.mean()), abs=1e-6)
    assert_close(loss, (cost * ls.detach()).mean())
    loss.backward()
    assert_close(ls.grad, cost / 2)  # advantage-weighted score, the cost is not differentiated


def test_tokenizer_check() -> None:
    class Tok:
        def __init__(self, v):
            self.v = v

        def get_vocab(self):
            return self.v

    check_same_tokenizer(Tok({"a": 0, "b": 1}), Tok({"b": 1, "a": 0}))
    with pytest.raises(ValueError, match="^teacher: tokenizer differs"):
        check_same_tokenizer(Tok({"a": 0, "b": 1}), Tok({"a": 1, "b": 0}))


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="^distill_estimator: got 'forward'; accepted: full, sampled"):
        TrainConfig(algo="opd", distill_estimator="forward")
    with pytest.raises(ValueError, match="^group: got 0; accepted range: >= 2, <= 64"):
        TrainConfig(algo="opd", group=0)
