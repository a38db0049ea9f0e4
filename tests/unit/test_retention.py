"""Retention arithmetic, the table, and the grid on a tiny random model (a density-1 mask must
reproduce the full run exactly: same prompts, same sampling seeds, same optimizer)."""

from __future__ import annotations

import math

import pytest

from compute.retention import build_table, markdown_table, mean_std, retention


def test_retention_formula() -> None:
    assert retention(0.3, 0.4, 0.2) == pytest.approx(0.5)
    assert retention(0.1, 0.4, 0.2) == pytest.approx(-0.5)
    assert math.isnan(retention(0.3, 0.2, 0.2))  # full training did not move: undefined


def test_mean_std_and_table() -> None:
    assert mean_std([1.0, 3.0]) == (2.0, pytest.approx(math.sqrt(2)))
    assert mean_std([2.0, float("nan")]) == (2.0, 0.0)
    t = build_table(0.2, [0.4, 0.6], {("fisher", 0.05): [0.3, 0.4], ("random", 0.05): [0.2, 0.6]})
    rows = {r["selector"]: r for r in t["rows"]}
    # per seed: (0.3-0.2)/(0.4-0.2) = 0.5, (0.4-0.2)/(0.6-0.2) = 0.5
    assert rows["fisher"]["retention_mean"] == pytest.approx(0.5)
    assert rows["fisher"]["retention_std"] == pytest.approx(0.0)
    assert rows["random"]["retentions"] == pytest.approx([0.0, 1.0])
    assert rows["random"]["retention_of_means"] == pytest.approx((0.4 - 0.2) / (0.5 - 0.2))
    md = markdown_table(t)
    assert "| fisher | 0.05 | 0.350 ± 0.071 | 0.50 ± 0.00 |" in md
    assert md.startswith("base held-out reward: 0.200; full training: 0.500 ± 0.141 (seeds: 2)")


@pytest.mark.slow
def test_grid_on_tiny_model_density_one_mask_equals_full() -> None:
    from compute.fisher import FisherConfig
    from compute.retention import run_retention
    from compute.tasks import get_task
    from compute.train import TrainConfig
    from tests.unit.fisher_tiny import char_tokenizer, tiny_model

    model, tok = tiny_model("qwen3"), char_tokenizer()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    cfg = TrainConfig(algo="sft", steps=3, batch=4, lr=3e-2, eval_prompts=20, max_new_tokens=3,
                      eval_max_new_tokens=3)
    table = run_retention(model, tok, get_task("arithmetic-add?digits=1"), cfg, ["random", "fisher"],
                          [0.2, 1.0], 2, FisherConfig(prompts=2, samples=2, max_new_tokens=3))
    rows = {(r["selector"], r["density"]): r for r in table["rows"]}
    assert len(rows) == 4 and table["runs"] == 2 * (1 + 4)
    # a mask keeping everything is the full run, bit for bit, whatever the selector
    assert rows[("random", 1.0)]["rewards"] == table["full_rewards"]
    assert rows[("fisher", 1.0)]["rewards"] == table["full_rewards"]
    assert rows[("fisher", 0.2)]["actual_density"] == pytest.approx(0.2, abs=1e-4)
    us = table["full_update_sparsity"]
    assert 0.0 <= us["unchanged_exact"] < 0.5  # full SFT moves most coordinates
    assert "fisher_precision_at_changed" in us
    for n, p in model.named_parameters():  # the caller's model is untouched
        assert p.detach().equal(start[n])
