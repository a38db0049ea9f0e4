"""Retention statistics (paired seeds x paired prompts, bootstrap intervals, the no-gain refusal),
the table, and the grid on the zoo's arith-base run as independent units (a density-1 mask must
reproduce the full run exactly: same prompts, same sampling seeds, same optimizer, same held-out
prompts)."""

from __future__ import annotations

import math

import pytest
import torch

from compute.studies.retention import (
    BootstrapConfig,
    build_table,
    eval_size_for_se,
    gain_stats,
    markdown_table,
    mean_std,
    retention,
    retention_row,
)


def bernoulli(n: int, p: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(n, generator=g, dtype=torch.float64) < p).double()


def flip(x: torch.Tensor, k: int, seed: int) -> torch.Tensor:
    """x with k of its zeros turned into ones (a model that solves k more prompts)."""
    zeros = torch.nonzero(x == 0).flatten()
    g = torch.Generator().manual_seed(seed)
    pick = zeros[torch.randperm(zeros.numel(), generator=g)[:k]]
    y = x.clone()
    y[pick] = 1.0
    return y


def test_retention_formula() -> None:
    assert retention(0.3, 0.4, 0.2) == pytest.approx(0.5)
    assert retention(0.1, 0.4, 0.2) == pytest.approx(-0.5)
    assert math.isnan(retention(0.3, 0.2, 0.2))  # full training did not move: undefined
    assert mean_std([1.0, 3.0]) == (2.0, pytest.approx(math.sqrt(2)))
    assert mean_std([2.0, float("nan")]) == (2.0, 0.0)


def test_eval_size_for_a_stated_standard_error() -> None:
    assert eval_size_for_se(0.01) == 2500
    assert eval_size_for_se(0.02) == 625
    assert eval_size_for_se(0.03) == 278
    for se in (0.005, 0.013, 0.05):  # the worst case (p = 1/2) meets the target
        assert math.sqrt(0.25 / eval_size_for_se(se)) <= se
    with pytest.raises(ValueError, match="eval_se"):
        eval_size_for_se(0.0)


def test_spec_picks_eval_size_from_eval_se() -> None:
    from compute.contract.specs import SpecError
    from compute.jobs.registry import parse_spec

    assert parse_spec("retention", {}).eval_prompts == 2500
    assert parse_spec("retention", {"eval_se": 0.02}).eval_prompts == 625
    assert parse_spec("retention", {"eval_se": 0.02, "eval_prompts": 100}).eval_prompts == 100
    with pytest.raises(SpecError, match="eval_se"):
        parse_spec("retention", {"eval_se": 0.9})


def test_bootstrap_se_matches_the_binomial_standard_error() -> None:
    # One seed, base = full: the bootstrap SE of a mean of n Bernoulli(p) is sqrt(p(1-p)/n).
    n, p = 2000, 0.3
    base = bernoulli(n, p, 0)
    full = bernoulli(n, 0.5, 1)[None]
    st = gain_stats(base, full, BootstrapConfig(replicates=4000, seed=1))
    pb = float(base.mean())
    assert st["base_se"] == pytest.approx(math.sqrt(pb * (1 - pb) / (n - 1)), rel=1e-9)
    pf = float(full.mean())
    assert st["full_se"] == pytest.approx(math.sqrt(pf * (1 - pf) / n), rel=0.1)
    assert st["gain_significant"]


def test_paired_prompts_make_a_small_gain_significant() -> None:
    # Full solves the same prompts as the base plus 40 of 1000 (+0.04). Unpaired, that is within
    # two standard errors of two independent accuracies (2 x 0.0145); paired, it is ~6 SE.
    base = bernoulli(1000, 0.5, 2)
    full = torch.stack([flip(base, 40, s) for s in range(3)])
    st = gain_stats(base, full, BootstrapConfig(replicates=2000))
    assert st["gain"] == pytest.approx(0.04)
    unpaired = math.sqrt(2 * 0.25 / 1000)
    assert st["gain_se"] < 0.5 * unpaired
    assert st["gain_significant"] and st["gain_ci"][0] > 0.02


def test_retention_ratio_of_means_and_intervals() -> None:
    base = bernoulli(1500, 0.3, 3)
    full = torch.stack([flip(base, 150 + 15 * s, 10 + s) for s in range(3)])  # gains .10, .11, .12
    masked = torch.stack([flip(base, 75 + 5 * s, 20 + s) for s in range(3)])  # .05, .053, .057
    t = build_table(base, full, {("fisher", 0.01): masked}, BootstrapConfig(replicates=2000))
    assert t["retention_valid"] and "warning" not in t
    r = t["rows"][0]
    want = (float(masked.mean()) - float(base.mean())) / (float(full.mean()) - float(base.mean()))
    assert r["retention"] == pytest.approx(want)
    assert r["retentions"] == pytest.approx(
        [(float(m.mean()) - float(base.mean())) / (float(f.mean()) - float(base.mean())) for m, f in zip(masked, full, strict=True)])
    for key in ("retention_ci", "retention_ci_seeds", "retention_ci_prompts"):
        lo, hi = r[key]
        assert lo <= r["retention"] <= hi, key
    # Prompt noise dominates here; the seed-only interval is narrower than the combined one.
    both = r["retention_ci"][1] - r["retention_ci"][0]
    assert r["retention_ci_seeds"][1] - r["retention_ci_seeds"][0] < both
    assert 0.3 < r["retention_ci"][0] and r["retention_ci"][1] < 0.75


def test_identical_seeds_give_a_zero_width_seed_interval() -> None:
    base = bernoulli(500, 0.3, 4)
    full = flip(base, 60, 5).expand(3, -1).clone()
    masked = flip(base, 30, 6).expand(3, -1).clone()
    r = retention_row(base, full, masked, BootstrapConfig(), valid=True)
    assert r["retention_ci_seeds"][0] == pytest.approx(r["retention"])
    assert r["retention_ci_seeds"][1] == pytest.approx(r["retention"])
    assert r["retention_ci_prompts"][1] > r["retention_ci_prompts"][0]


def test_no_retention_when_full_training_does_not_beat_the_base() -> None:
    # What a 3-step run looks like: full training moves the reward by less than its noise. The
    # old table printed a ratio like -2.33; now there is no number and a warning.
    base = bernoulli(600, 0.3, 7)
    full = torch.stack([bernoulli(600, 0.3, 8 + s) for s in range(2)])
    masked = torch.stack([bernoulli(600, 0.28, 20 + s) for s in range(2)])
    t = build_table(base, full, {("fisher", 0.01): masked, ("random", 0.01): masked})
    assert not t["gain_significant"] and not t["retention_valid"]
    assert t["gain_ci"][0] <= 0.0
    assert "did not beat the base beyond its error" in t["warning"]
    for r in t["rows"]:
        assert r["retention"] is None and r["retention_ci"] is None and r["retentions"] is None
        assert r["reward_mean"] == pytest.approx(float(masked.mean()))  # rewards still shown
    md = markdown_table(t)
    assert "WARNING" in md and "| fisher | 0.01 |" in md
    row = next(line for line in md.splitlines() if line.startswith("| fisher"))
    assert row.count("n/a") == 5  # retention, three intervals, per-seed


def test_markdown_table_rows() -> None:
    base = torch.tensor([0.0, 0.0, 1.0, 0.0] * 50, dtype=torch.float64)
    full = torch.tensor([[1.0, 0.0, 1.0, 0.0] * 50, [1.0, 0.0, 1.0, 0.0] * 50], dtype=torch.float64)
    masked = torch.tensor([[1.0, 0.0, 1.0, 0.0] * 50, [0.0, 0.0, 1.0, 0.0] * 50], dtype=torch.float64)
    t = build_table(base, full, {("fisher", 0.05): masked})
    md = markdown_table(t)
    assert md.startswith("base held-out reward 0.250 (SE 0.031, 200 prompts); full training 0.500")
    # masked: seed 0 keeps the whole gain, seed 1 none: ratio of means 0.5, per seed 1.00, 0.00
    assert "| fisher | 0.05 | 0.375 " in md and "| 0.50 |" in md and "| 1.00, 0.00 |" in md


def _as_shipped(output: object) -> object:
    """A unit's output as a worker ships it to the parent (the worker's own dump/load)."""
    from compute.jobs.runners import dump_output, load_output

    return load_output(dump_output(output))


def _comparable(result: object) -> dict:
    import json

    d = json.loads(json.dumps(result.to_dict(), default=str))  # type: ignore[attr-defined]
    d["summary"].pop("seconds")
    d["summary"].pop("seconds_parts")
    return d


@pytest.mark.slow
def test_grid_units_apart_equal_the_run_and_density_one_equals_full(zoo_home, monkeypatch) -> None:
    """The grid as child jobs would run it (base evaluation and every arm as its own unit, each
    estimating its own Fisher, outputs through torch.save / weights-only load, in reverse order)
    combines to the in-process run; a density-1 mask reproduces the full run prompt for prompt
    (paired seeds: same prompts, same sampling seeds, same optimizer, same held-out prompts)."""
    from compute.jobs.registry import parse_spec
    from compute.jobs.retention_run import children, combine, run, run_child
    from compute.lm.causal_lm import load_model

    monkeypatch.setenv("FISHERLENS_HOME", str(zoo_home))
    spec = parse_spec("retention", {"model": "arith-base", "selectors": ["random", "fisher"],
                                    "densities": [0.2, 1.0], "seeds": 2, "steps": 2, "eval_prompts": 20,
                                    "fisher_prompts": 4, "fisher_samples": 2, "bootstrap": 200, "batch": 4,
                                    "group": 2, "max_new_tokens": 4, "device": "cpu"})
    n = children(spec)
    assert n == 1 + 2 * (1 + 4)
    import compute.fisher as fisher_mod

    made = []  # the Fishers the grid estimates, in one process: one for both seeds (FISHER_SEED)
    real = fisher_mod.estimate_fisher
    monkeypatch.setattr(fisher_mod, "estimate_fisher", lambda *a, **k: made.append(1) or real(*a, **k))
    shared: dict = {}
    outputs = [run_child(spec, i, shared=shared) for i in range(n)]
    assert len(made) == 1
    from compute.contract import cost as C
    from compute.jobs.retention import timing

    z = C.Sizing(params=10**5, layers=2, hidden=64, vocab=32, intermediate=128, prompt_tokens=7)
    one = sum(C.fisher_seconds(z, 4, 2, 4, statistics=False).values())
    assert timing(spec, z)["initial Fisher"] == pytest.approx(one)  # was counted once per seed
    monkeypatch.setattr(fisher_mod, "estimate_fisher", real)
    whole = combine(spec, outputs)
    # where the time went, by the estimate's own parts (timing): the load and the Fisher once,
    # the masks, the steps and evaluations of every arm, the full arms' end; together the units' time
    took = whole.summary["seconds_parts"]
    assert set(took) == {"load", "initial Fisher", "masks", "steps", "evaluation", "finish"}, took
    assert set(took) == set(timing(spec, z))
    assert all(v > 0 for v in took.values()), took
    assert sum(took.values()) == pytest.approx(whole.summary["seconds"], rel=0.02, abs=0.1)
    # how long every arm's sampled completions ran, one record (10 arms x 2 steps x 4 x 2 rows;
    # the base's greedy evaluation samples none)
    rec = whole.summary["completion_lengths"]
    assert rec["rows"] == 10 * 2 * 4 * 2 and rec["max_new_tokens"] == 4
    apart = {i: _as_shipped(run_child(spec, i)) for i in reversed(range(n))}
    assert _comparable(combine(spec, [apart[i] for i in range(n)])) == _comparable(whole)
    assert _comparable(run(spec)) == _comparable(whole)
    assert [(o["seed"], o["selector"], o["density"]) for o in outputs[1:6]] == \
        [(0, None, None), (0, "random", 0.2), (0, "random", 1.0), (0, "fisher", 0.2), (0, "fisher", 1.0)]
    table = whole.summary
    rows = {(r["selector"], r["density"]): r for r in table["rows"]}
    assert len(rows) == 4 and table["runs"] == 2 * (1 + 4)
    per_prompt = {k: v.tolist() for k, v in whole.tensors["rewards"].items()}
    assert len(per_prompt["base"]) == 20 and len(per_prompt["full"]) == 2
    # a mask keeping everything is the full run, prompt for prompt, whatever the selector
    assert per_prompt["random@1"] == per_prompt["full"]
    assert per_prompt["fisher@1"] == per_prompt["full"]
    assert rows[("fisher", 1.0)]["rewards"] == table["full_rewards"]
    assert rows[("fisher", 0.2)]["actual_density"] == pytest.approx(0.2, abs=1e-4)
    assert "fisher_precision_at_changed" in table["full_update_sparsity"]
    assert table["fisher"]["rows"] == 4 * 2
    fresh, _ = load_model("arith-base", device=torch.device("cpu"), dtype=spec.dtype)
    start = dict(fresh.named_parameters())
    for k, p in shared["loaded"].model.named_parameters():  # every arm trained a copy
        assert p.detach().equal(start[k].detach())
    with pytest.raises(ValueError, match="index"):
        run_child(spec, n, shared=shared)
    with pytest.raises(ValueError, match="outputs"):
        combine(spec, outputs[:-1])


def _result(table: dict) -> dict:
    import json

    from app.commands.experiments import json_safe

    return json.loads(json.dumps(json_safe({"kind": "retention", "summary": table, "series": [], "heatmaps": []})))


def test_retention_view_shows_intervals() -> None:
    from app import plots

    base = bernoulli(800, 0.3, 30)
    full = torch.stack([flip(base, 120, 31 + s) for s in range(3)])
    t = build_table(base, full, {("fisher", 0.01): torch.stack([flip(base, 60, 40 + s) for s in range(3)]),
                                 ("fisher", 0.05): torch.stack([flip(base, 100, 50 + s) for s in range(3)])})
    res = _result(t)
    fig = plots.retention_figure(res)
    (tr,) = fig.data
    rows = sorted(t["rows"], key=lambda r: r["density"])
    assert list(tr.y) == pytest.approx([r["retention"] for r in rows])
    assert list(tr.error_y.array) == pytest.approx([r["retention_ci"][1] - r["retention"] for r in rows])
    assert list(tr.error_y.arrayminus) == pytest.approx([r["retention"] - r["retention_ci"][0] for r in rows])
    h, table_rows = plots.retention_table(res)
    assert "retention_ci" in h and "retention_ci_prompts" in h


def test_retention_view_refuses_a_ratio_within_noise() -> None:
    from app import plots

    base = bernoulli(400, 0.3, 60)
    full = torch.stack([bernoulli(400, 0.3, 61 + s) for s in range(2)])
    t = build_table(base, full, {("fisher", 0.01): torch.stack([bernoulli(400, 0.25, 70 + s) for s in range(2)])})
    res = _result(t)
    fig = plots.retention_figure(res)
    (tr,) = fig.data
    assert list(tr.y) == pytest.approx([t["rows"][0]["reward_mean"]])  # the reward, not a ratio
    assert any("No retention" in (a.text or "") for a in fig.layout.annotations)
    assert "retention =" not in (fig.layout.yaxis.title.text or "")
    h, table_rows = plots.retention_table(res)
    col = h.index("retention")
    assert all(r[col] in (None, "", "n/a") for r in table_rows)
    from app.figures.keynumbers import key_numbers

    kn = key_numbers(res)  # the share page says the same
    assert len(kn["warnings"]) == 1 and "did not beat the base beyond its error" in kn["warnings"][0]
    assert kn["table"]["rows"][0][3] == "n/a"


def test_retention_cli_bad_values_exit_2(tmp_path, fl_home) -> None:
    from click.testing import CliRunner

    from app.cli import main

    for args, flag in ((["--densities", "0.1,abc"], "--densities"), (["--densities", "0,0.1"], "--densities"),
                       (["--eval-se", "0.7"], "--eval-se"), (["--confidence", "1"], "--confidence"),
                       (["--bootstrap", "5"], "--bootstrap"), (["--seeds", "0"], "--seeds")):
        res = CliRunner().invoke(main, ["retention", *args, "--out", str(tmp_path)])
        assert res.exit_code == 2, res.output
        assert flag in res.output and len(res.output.strip().splitlines()) == 1, res.output


@pytest.mark.slow
def test_retention_cli_on_the_zoo_records_provenance(zoo_home, tmp_path, monkeypatch) -> None:
    import hashlib
    import json

    from click.testing import CliRunner
    from safetensors.torch import load_file

    from app.cli import main

    monkeypatch.setenv("FISHERLENS_HOME", str(zoo_home))
    out = tmp_path / "ret"
    res = CliRunner().invoke(main, ["retention", "--steps", "2", "--seeds", "1", "--selectors", "fisher",
                                    "--densities", "0.05", "--eval-se", "0.05", "--fisher-prompts", "4",
                                    "--bootstrap", "200", "--device", "cpu", "--out", str(out)])
    assert res.exit_code == 0, res.output
    data = json.loads((out / "retention.json").read_text())
    s = data["summary"]
    assert s["eval_prompts"] == 100 and data["spec"]["eval_se"] == 0.05
    assert s["runs"] == 2 and len(s["rows"]) == 1
    prov = data["provenance"]
    assert prov["command"] == ("fisherlens retention --fisher-prompts 4 --device cpu --densities 0.05 "
                               f"--selectors fisher --seeds 1 --steps 2 --eval-se 0.05 --bootstrap 200 --out {out}")
    weights = zoo_home / "zoo" / "arith-base" / "model.safetensors"
    assert prov["models"]["arith-base"]["sha256"]["model.safetensors"] == hashlib.sha256(weights.read_bytes()).hexdigest()
    rewards = load_file(str(out / "rewards.safetensors"))
    assert rewards["base"].shape == (100,) and rewards["full"].shape == (1, 100)
    assert float(rewards["base"].mean()) == pytest.approx(s["base_reward"], abs=1e-6)
    # either a retention with its interval, or none and the warning: never a bare ratio
    row = s["rows"][0]
    if s["retention_valid"]:
        assert row["retention_ci"] is not None
    else:
        assert row["retention"] is None and "warning: No retention reported" in res.output
    assert (out / "retention.md").read_text() == s["markdown"]


def test_bootstrap_in_chunks_is_bounded_and_consistent(monkeypatch) -> None:
    # Replicates are drawn in chunks (bounded memory whatever replicates x prompts); the statistics
    # do not depend on the chunking beyond bootstrap noise.
    import compute.studies.retention as R

    base = bernoulli(1000, 0.3, 80)
    full = torch.stack([flip(base, 100, 81 + s) for s in range(2)])
    one = R.gain_stats(base, full, BootstrapConfig(replicates=3000))
    monkeypatch.setattr(R, "CHUNK_ELEMENTS", 100_000)  # 30 chunks of 100 replicates
    assert len(R._draws(2, 1000, BootstrapConfig(replicates=3000))["both"].chunks) == 30
    many = R.gain_stats(base, full, BootstrapConfig(replicates=3000))
    assert many["gain"] == one["gain"]
    assert many["gain_se"] == pytest.approx(one["gain_se"], rel=0.1)
    assert many["gain_ci"] == pytest.approx(one["gain_ci"], abs=0.005)
