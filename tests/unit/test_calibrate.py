"""The calibrated cost model: `fisherlens calibrate` measures a and b of
seconds = token_passes x (a + b x params) on this machine, estimates and time ceilings use it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from app import ceiling, limits
from app.cli import main
from compute.contract.settings import Settings


def test_calibrate_writes_a_model_the_estimates_use(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FISHERLENS_HOME", str(tmp_path))
    res = CliRunner().invoke(main, ["calibrate", "--device", "cpu"])
    assert res.exit_code == 0, res.output
    data = json.loads((tmp_path / "throughput.json").read_text())
    a, b = data["seconds_per_token_pass"], data["seconds_per_param_token_pass"]
    (p0, p1) = (p["params"] for p in data["points"])
    assert a >= 0 and b > 0 and p1 > 100 * p0
    # the two measured points lie on the fitted line (a is clamped at 0 only if it came out < 0)
    s1 = data["points"][1]["seconds_per_token_pass"]
    assert a + b * p1 == pytest.approx(s1, rel=1e-6) or a == 0
    settings = Settings(fisherlens_home=tmp_path)
    got = ceiling.seconds_of(settings, 1000, 5_000_000)
    assert got is not None and got[0] == pytest.approx(1000 * (a + b * 5_000_000))
    assert got[1].startswith("calibrated")


def test_run_time_limit_compares_the_estimated_seconds(tmp_path: Path) -> None:
    (tmp_path / "throughput.json").write_text(json.dumps(
        {"seconds_per_token_pass": 1e-3, "seconds_per_param_token_pass": 1e-9}))
    settings = Settings(fisherlens_home=tmp_path)
    # a tiny model: the fixed part dominates; 10,000 token-passes x (1e-3 + 1e-9 x 1e5) = 11 s
    seconds = ceiling.seconds_of(settings, 10_000, 100_000)
    assert seconds is not None and seconds[0] == pytest.approx(11.0)
    est = {"cost": 10_000 * 100_000.0, "seconds": seconds[0], "token_passes": 10_000,
           "params": 100_000, "unknown_models": [], "seconds_from": seconds[1]}
    assert limits.within_ceiling(est, 1.0, 12.0)  # the cost ceiling is not what a time limit compares
    assert not limits.within_ceiling(est, 1e20, 10.0)
    with pytest.raises(limits.SpecError, match="exceeds your per-job ceiling of 10 s"):
        limits.check_cost(est, 1e20, 10.0)


def test_without_a_calibration_of_its_own_a_machine_is_priced_by_the_reference_one(tmp_path: Path) -> None:
    """No calibration here: the committed benchmarks/results/throughput.json's a and b (the
    reference machine's, measured by `fisherlens calibrate`'s code in bench_throughput.py) price
    the job, and the estimate says whose they are and how to do better; an operator's file of
    the one-constant form wins over the reference (it is this deployment's own)."""
    committed = json.loads(ceiling.REPO_THROUGHPUT.read_text())
    a, b = committed["seconds_per_token_pass"], committed["seconds_per_param_token_pass"]
    settings = Settings(fisherlens_home=tmp_path)
    assert ceiling.calibration(settings) == (a, b, ceiling.REFERENCE)
    got = ceiling.seconds_of(settings, 1000, 1_000_000)
    assert got is not None and got[0] == pytest.approx(1000 * (a + b * 1_000_000))
    assert got[1].startswith("the reference machine's calibration")
    assert "not this machine's: `fisherlens calibrate`" in got[1]  # the estimate says how to do better
    # SmolLM2-135M's default Fisher (101 s on that machine) is priced in minutes, not days (the
    # one constant of the 108,800-parameter zoo model said 12.8 days)
    smol = ceiling.seconds_of(settings, 102_400, 134_515_008)
    assert smol is not None and 30 < smol[0] < 600
    (tmp_path / "throughput.json").write_text(json.dumps({"param_token_passes_per_s": 2e9}))
    assert ceiling.calibration(settings) is None
    got = ceiling.seconds_of(settings, 1000, 1_000_000)
    assert got is not None and got[0] == pytest.approx(1000 * 1_000_000 / 2e9)
    assert "not this machine's: `fisherlens calibrate`" in got[1]
