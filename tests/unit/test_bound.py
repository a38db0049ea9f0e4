"""The per-coordinate Cauchy-Schwarz bound |mean A s| <= sqrt(mean A^2) sqrt(mean s^2)."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from compute.bound import (
    accumulate_sample_grads,
    bound_from_sample_grads,
    holds,
    pearson,
    spearman,
    summarize,
)
from tests.unit.fisher_tiny import tiny_model


def test_bound_holds_on_random_tensors_and_is_tight_when_a_matches_the_score() -> None:
    g = torch.Generator().manual_seed(0)
    grads = torch.randn(16, 500, generator=g) * torch.rand(500, generator=g)
    adv = torch.randn(16, generator=g)
    lhs, rhs, fisher = bound_from_sample_grads(grads, adv)
    assert bool(holds(lhs, rhs).all())
    assert_close(fisher, (grads.double() ** 2).mean(0))
    # equality case: A proportional to the score of coordinate 7
    lhs, rhs, _ = bound_from_sample_grads(grads, -3.0 * grads[:, 7])
    assert_close(lhs[7], rhs[7], rtol=1e-12, atol=0)
    assert float((lhs / rhs).max()) == pytest.approx(1.0, abs=1e-12)


def test_check_catches_a_mismatched_sample_set() -> None:
    """If the LHS and the RHS use different samples the inequality is not guaranteed: the
    fraction must then drop below 1, which shows the check can fail."""
    g = torch.Generator().manual_seed(1)
    a_grads = torch.randn(8, 2000, generator=g)
    b_grads = 0.3 * torch.randn(8, 2000, generator=g)  # another, smaller-score sample set
    adv = torch.randn(8, generator=g)
    lhs, _, _ = bound_from_sample_grads(a_grads, adv)
    _, rhs_b, _ = bound_from_sample_grads(b_grads, adv)
    assert float(holds(lhs, rhs_b).double().mean()) < 0.9


def test_per_sample_grads_match_brute_force_and_bound_holds_on_tiny_model() -> None:
    model = tiny_model("qwen3")
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 16, (5, 7), generator=gen)
    am = torch.ones_like(ids)
    am[1, 5:] = 0  # one right-padded row
    cm = torch.zeros_like(ids, dtype=torch.bool)
    cm[:, 3:] = True
    cm &= am.bool()
    adv = torch.tensor([1.0, -0.5, 2.0, 0.0, -1.5])
    res = accumulate_sample_grads(model, ids, am, cm, adv)
    # brute force: full score vectors stacked, via the model's own loss on each row
    rows = []
    for i in range(5):
        model.zero_grad()
        w = int(am[i].sum())
        logits = model(input_ids=ids[i : i + 1, :w]).logits[0, :-1]  # (w-1, V)
        lp = logits.log_softmax(-1).gather(-1, ids[i, 1:w, None]).squeeze(-1)
        (lp * cm[i, 1:w]).sum().backward()
        rows.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    lhs, rhs, fisher = bound_from_sample_grads(torch.stack(rows), adv)
    names = [n for n, _ in model.named_parameters()]
    assert_close(torch.cat([res.lhs[n].flatten() for n in names]), lhs, rtol=1e-4, atol=1e-7)
    assert_close(torch.cat([res.fisher[n].flatten() for n in names]), fisher, rtol=1e-4, atol=1e-9)
    summary, series, heatmaps = summarize(res)
    assert summary["bound_fraction_holds"] == 1.0 and summary["bound_violations"] == 0
    assert summary["bound_max_ratio"] <= 1 + 1e-5
    assert summary["grad_sqrt_fisher_spearman"] > 0.3  # small Fisher means small gradient
    assert len(series) == 2 * min(3000, summary["bound_coordinates"])
    assert heatmaps and heatmaps[0].meta["x"] == "log10 sqrt(F_i)"


def test_rank_correlations() -> None:
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert spearman(x, x**3) == pytest.approx(1.0)
    assert spearman(x, -x) == pytest.approx(-1.0)
    assert pearson(x, 2 * x + 1) == pytest.approx(1.0)
    # ties share their mean rank: ranks of (1, 1, 2) are (0.5, 0.5, 2)
    assert spearman(torch.tensor([1.0, 1.0, 2.0]), torch.tensor([0.0, 0.0, 5.0])) == pytest.approx(1.0)
