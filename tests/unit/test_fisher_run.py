"""compute.jobs.fisher_run (job + shards) and `fisherlens fisher` on the real zoo model."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from app.cli import main
from compute.jobs.fisher import FisherSpec
from compute.jobs.fisher_run import finish, run, run_shard, shard_range


@pytest.fixture
def home(zoo_home, monkeypatch):
    monkeypatch.setenv("FISHERLENS_HOME", str(zoo_home))
    monkeypatch.setenv("FISHERLENS_DEVICE", "cpu")
    return zoo_home


def test_shard_ranges_cover_prompts():
    spec = FisherSpec(model="arith-base", prompts=7, shards=3)
    ranges = [shard_range(spec, i) for i in range(3)]
    assert ranges[0][0] == 0 and ranges[-1][1] == 7
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    with pytest.raises(ValueError, match="^shard_index:"):
        shard_range(spec, 3)


@pytest.mark.slow
def test_run_equals_finish_of_shards_and_is_worker_independent(home):
    spec = FisherSpec(model="arith-base", prompts=5, samples=2, max_new_tokens=4, shards=2, seed=3)
    res = run(spec)
    # shards computed separately (as on two workers, in any order) give the identical result
    outs = [run_shard(spec, 1), run_shard(spec, 0)]
    again = finish(spec, outs)
    f, g = res.tensors["fisher"], again.tensors["fisher"]
    assert list(f) == list(g)
    assert all(torch.equal(f[n], g[n]) for n in f)
    # one shard over all prompts: same samples, same Fisher up to summation order
    one = run(spec.model_copy(update={"shards": 1})).tensors["fisher"]
    for n in f:
        torch.testing.assert_close(one[n], f[n], rtol=1e-5, atol=1e-7 * float(f[n].max()) + 1e-12)
    s = res.summary
    assert s["n_rows"] == 10 and s["estimator"] == "sequence" and s["shards"] == 2
    assert 0.0 <= s["split_half_jaccard"] <= 1.0
    assert set(s["exact_output"]) == {"lm_head.weight"}
    assert s["exact_output"]["lm_head.weight"]["relative_l1_error"] >= 0
    assert set(f) == {n for n, _ in _params(home)}
    assert {h.name for h in res.heatmaps} == {"fisher/mean", "fisher/share"}
    assert res.series and res.series[-1].value == pytest.approx(1.0)
    json.dumps(res.to_dict())  # JSON-able


def _params(home):
    from compute.lm.causal_lm import load_model

    model, _ = load_model(str(home / "zoo" / "arith-base"), device="cpu")
    return list(model.named_parameters())


@pytest.mark.slow
def test_cli_fisher_writes_outputs(home, tmp_path):
    out = tmp_path / "f"
    r = CliRunner().invoke(main, ["fisher", "--model", "arith-base", "--prompts", "3",
                                  "--samples", "2", "--max-new-tokens", "4", "--estimator",
                                  "token", "--seed", "1", "--out", str(out)])
    assert r.exit_code == 0, r.output
    tensors = load_file(str(out / "fisher.safetensors"))
    assert set(tensors) == {n for n, _ in _params(home)}
    assert all(t.dtype == torch.float32 and (t >= 0).all() for t in tensors.values())
    stats = json.loads((out / "stats.json").read_text())
    assert stats["kind"] == "fisher" and stats["summary"]["estimator"] == "token"
    assert stats["summary"]["n_samples"] == stats["summary"]["n_tokens"]
    assert "Fisher mass in the top 1% of coordinates" in r.output and "wrote" in r.output, r.output


@pytest.mark.parametrize("args,flag", [
    (["--prompts", "0"], "--prompts"), (["--samples", "1000"], "--samples"),
    (["--estimator", "magic"], "--estimator"), (["--temperature", "0"], "--temperature"),
    (["--top-p", "2"], "--top-p"),
])
def test_cli_bad_values_exit_2(fl_home, tmp_path, args, flag):
    r = CliRunner().invoke(main, ["fisher", "--model", "arith-base", "--out", str(tmp_path), *args])
    assert r.exit_code == 2
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and flag in lines[0] and lines[0].startswith("error:")


@pytest.mark.parametrize("args,field", [
    (["--model", "no-such-model"], "model:"), (["--model", "arith-base", "--task", "poetry"], "task:"),
])
def test_cli_bad_model_or_task_exit_2(fl_home, tmp_path, args, field):
    r = CliRunner().invoke(main, ["fisher", *args, "--out", str(tmp_path)])
    assert r.exit_code == 2
    assert field in r.output and len([ln for ln in r.output.splitlines() if ln.strip()]) == 1


def test_finish_reports_why_the_exact_output_check_was_skipped():
    spec = FisherSpec(model="arith-base", prompts=2, shards=1)
    reason = "model: the logits of X are not the output layer applied to the last hidden state"
    out = {"shard": 0, "prompt_range": [0, 2], "n_rows": 2, "n_tokens": 4, "seconds": 0.1,
           "sums": {"model.layers.0.mlp.up_proj.weight": torch.rand(2, 4, 3)},
           "denoms": [1.0, 1.0], "exact": None, "exact_skipped": reason}
    res = finish(spec, [out])
    assert res.summary["exact_output_skipped"] == reason
    assert "exact_output" not in res.summary


def test_bf16_fisher_checks_float32_in_place_and_skips_when_it_would_not_fit(home, monkeypatch):
    """Issue 30 items 1 and 3: a half-precision Fisher's error check loads no float32 copy of the
    model: the job's own model is made float32 in place (the float32 checkpoint's own values) and
    given back bit for bit. It runs within what the job's allowance leaves (precision_check_plan);
    when the memory free is less than it needs, the result says the check was skipped and why.
    The Fisher is the same bit for bit either way (its sums are float32, the check only reads)."""
    from app.figures.keynumbers import key_numbers
    from compute.jobs import fisher_run
    from compute.lm import device

    spec = FisherSpec(model="arith-base", prompts=4, samples=2, max_new_tokens=4, dtype="bfloat16",
                      device="cpu", memory_budget_mb=64, exact_output=False)
    loads: list[str] = []
    real_load = fisher_run._load
    kept: list = []

    def counting_load(s, refs):
        loads.append(s.dtype)
        kept.append(real_load(s, refs))
        return kept[-1]

    monkeypatch.setattr(fisher_run, "_load", counting_load)
    checked = fisher_run.run(spec)
    assert loads == ["bfloat16"]  # no second load, in float32 or otherwise
    err = checked.summary["precision_error"]
    assert 0 < err["relative_l1"] < 0.5 and err["reference"].startswith("the checkpoint's float32 values")
    assert "precision_error_skipped" not in checked.summary
    model = kept[-1][0]
    fresh, _ = real_load(spec, None)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    for (n, p), (_, q) in zip(model.state_dict().items(), fresh.state_dict().items(), strict=True):
        assert p.dtype == q.dtype and torch.equal(p, q), n  # restored bit for bit, buffers too

    loads.clear()
    n = sum(t.numel() for t in checked.tensors["fisher"].values())
    monkeypatch.setattr(device, "free_memory_bytes", lambda _dev: 4 * n)  # less than the check needs
    skipped = fisher_run.run(spec)
    assert loads == ["bfloat16"]
    assert "precision_error" not in skipped.summary
    why = skipped.summary["precision_error_skipped"]
    assert why.startswith("not measured: scoring the first rows again in float32 needs"), why
    assert any("its error against float32 was not measured" in w for w in key_numbers(skipped.to_dict())["warnings"])
    a, b = checked.tensors["fisher"], skipped.tensors["fisher"]
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def test_progress_names_every_phase_after_the_sums(home):
    """Issue 30: nothing after the Fisher's sums sits silently at one fraction: the exact
    output-layer check, the split-half overlap, the Fisher, the histogram, the curve and the layer
    tables each report their own step, in order, with fractions that never go back."""
    trace: list[tuple[float, str]] = []
    spec = FisherSpec(model="arith-base", prompts=4, samples=2, max_new_tokens=4)
    res = run(spec, lambda f, m="": trace.append((f, m)))
    fr = [f for f, _ in trace]
    assert fr == sorted(fr) and fr[-1] == 1.0
    after = [m for f, m in trace if f >= 0.9]
    for phase in ("exact output-layer Fisher", "split-half overlap", "the Fisher from the sums",
                  "histogram", "concentration and Gini", "layers and modules"):
        assert any(phase in m for m in after), (phase, after)
    assert res.summary["split_half_precision"]["half_error_bound"] > 0
    assert res.summary["gini_error_bound"] < 1e-3


def test_the_statistics_passes_report_their_progress_slice_by_slice(home, monkeypatch):
    """Issue 30: a pass over all coordinates is seconds at 100M parameters on a CPU, minutes at
    8B: the split-half overlap's two passes and the histogram's report after every slice of
    values (statistics.Reported), rising through their share of the bar, never back, the same
    numbers as without a listener."""
    from compute.fisher import statistics as st

    spec = FisherSpec(model="arith-base", prompts=4, samples=2, max_new_tokens=4)
    quiet = run(spec)
    monkeypatch.setattr(st, "CHUNK", 4096)  # arith-base: about 25 slices a pass
    trace: list[tuple[float, str]] = []
    res = run(spec, lambda f, m="": trace.append((f, m)))
    fr = [f for f, _ in trace]
    assert fr == sorted(fr) and fr[-1] == 1.0
    n = sum(t.numel() for t in res.tensors["fisher"].values())
    slices = -(-n // 4096)
    overlap = sorted({f for f, m in trace if "split-half overlap" in m and 0.9 < f <= 0.94})
    assert len(overlap) >= slices and overlap[-1] == pytest.approx(0.94)  # two passes, one listened to
    assert overlap[len(overlap) // 2] == pytest.approx(0.92, abs=0.01)  # the first pass ends half way
    hist = sorted({f for f, m in trace if "histogram of the values" in m and f > 0.95})
    assert len(hist) >= slices - 1 and hist[-1] == pytest.approx(0.96)
    assert res.summary["split_half_jaccard"] == quiet.summary["split_half_jaccard"]
    # the same sums in other slices: float64 bin sums added in another order
    assert res.summary["gini"] == pytest.approx(quiet.summary["gini"], rel=1e-12)
    assert res.summary["top1%_share"] == pytest.approx(quiet.summary["top1%_share"], rel=1e-12)


@pytest.mark.parametrize("total", [1.0, 3.0, 7.0, 12_345.0, 2.0**24 - 1, 2.0**24 + 1, 6.5e6 + 0.25])
def test_divide_gives_the_float64_quotient_rounded_once_bit_for_bit(total):
    """The Fisher from the sums: one float32 division where the denominator is a float32 (the
    fast path) and the float64 route otherwise give each value the float32 nearest s / total,
    subnormal quotients and both the owned (in place) and the copied output included."""
    import torch

    from compute.jobs.fisher_run import divide

    g = torch.Generator().manual_seed(int(total) % 1000)
    s = torch.cat([(torch.randn(200_000, generator=g) * 8).exp(), torch.rand(1000, generator=g) * 1e-38,
                   torch.tensor([0.0, 1.0, 3.0, 2.0**-149, 3.4e38])])
    want = (s.double() / total).float()
    assert torch.equal(divide(s, total).view(torch.int32), want.view(torch.int32))
    own = s.clone()
    got = divide(own, total, in_place=True)
    assert got.data_ptr() == own.data_ptr() and torch.equal(got.view(torch.int32), want.view(torch.int32))
