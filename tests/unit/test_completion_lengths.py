"""How long sampled completions run, recorded by the jobs that sample and read back by the next
estimate (compute.contract.cost.length_record / expected_batch_steps, app.limits.stop_history):
a batch decodes until its longest row ends, so a model that answers in a few tokens samples in a
fraction of max_new_tokens; the estimate had priced every batch to the limit (issue 30: GRPO on
the arithmetic zoo model about 2x its clock)."""

from __future__ import annotations

import itertools

import pytest

from compute.contract import cost as C


def _rows(record: dict) -> list[float]:
    """A record's rows as lengths, an open row (never seen to end) as infinity."""
    out: list[float] = []
    for k, v in record["stopped"].items():
        out += [float(k)] * int(v)
    return out + [float("inf")] * int(record["open"])


def test_a_batchs_expected_steps_equal_the_mean_over_every_batch_drawn_from_the_rows() -> None:
    """E[min(m, longest of b rows)] with the rows drawn independently from the recorded ones,
    against the mean over all 10^b ordered draws: below, at and above the record's own limit (an
    open row counts as running on), and one row per batch."""
    rec = C.length_record([(3, True)] * 4 + [(5, True)] * 2 + [(1, True), (7, True), (8, False), (8, False)], 8)
    assert rec == {"max_new_tokens": 8, "rows": 10, "stopped": {"1": 1, "3": 4, "5": 2, "7": 1}, "open": 2}
    rows = _rows(rec)
    for b, m in itertools.product((1, 2, 3), (2, 4, 8, 12)):
        brute = sum(min(m, max(draw)) for draw in itertools.product(rows, repeat=b)) / len(rows) ** b
        assert C.expected_batch_steps([rec], b, m) == pytest.approx(brute, rel=1e-12), (b, m)
    assert C.expected_batch_steps(None, 4, 16) == 16.0 and C.expected_batch_steps([], 4, 16) == 16.0


def test_the_survival_of_records_of_two_limits_is_kaplan_meiers() -> None:
    """Records of different limits are merged by Kaplan-Meier, each open row censored at its own
    record's limit. Computed by hand: six rows at risk of ending at 2, three end (S = 1/2); the
    two open at 4 leave the risk set after 4; the one left ends at 6 (S = 0)."""
    a = {"max_new_tokens": 4, "rows": 4, "stopped": {"2": 2}, "open": 2}
    b = {"max_new_tokens": 8, "rows": 2, "stopped": {"2": 1, "6": 1}, "open": 0}
    assert C.length_survival([a, b], 9) == [1.0, 1.0, 0.5, 0.5, 0.5, 0.5, 0.0, 0.0, 0.0]
    # a limit past every record: the survival stays where the last row at risk left it
    assert C.length_survival([a], 7) == [1.0, 1.0, 0.5, 0.5, 0.5, 0.5, 0.5]
    assert C.merge_length_records([a, {**a, "stopped": {"3": 1}, "open": 3}]) == {
        "max_new_tokens": 4, "rows": 8, "stopped": {"2": 2, "3": 1}, "open": 5}
    with pytest.raises(ValueError, match="^completion_lengths: "):
        C.merge_length_records([a, b])


def test_sampling_is_priced_by_the_lengths_recorded_at_its_temperature() -> None:
    """Every recorded completion ended at 5 tokens: sampling 16 at most costs what sampling 5
    did unrecorded, for any batch; greedy decoding (no temperature) and another temperature
    keep the upper bound; so do a train's steps and a Fisher's sampling and passes."""
    rec = {"max_new_tokens": 32, "rows": 64, "stopped": {"5": 64}, "open": 0}
    bare = C.Sizing(params=10**6, layers=4, hidden=64, a=1e-5, b=2e-11)
    seen = C.Sizing(params=10**6, layers=4, hidden=64, a=1e-5, b=2e-11, stops={1.0: [rec]})
    for rows, batch in ((64, 64), (100, 32), (3, 8)):
        assert seen.generate_s(rows, 16, batch, temperature=1.0) == pytest.approx(bare.generate_s(rows, 5, batch))
        assert seen.generate_s(rows, 16, batch) == bare.generate_s(rows, 16, batch)  # greedy
        assert seen.generate_s(rows, 16, batch, temperature=0.7) == bare.generate_s(rows, 16, batch)
    short = C.train_seconds(seen, "grpo", 3, 4, 4, 16, 8)
    assert short["steps"] == pytest.approx(C.train_seconds(bare, "grpo", 3, 4, 4, 5, 8)["steps"])
    assert short["evaluation"] == C.train_seconds(bare, "grpo", 3, 4, 4, 16, 8)["evaluation"]
    fisher = C.fisher_seconds(seen, 8, 4, 16)
    assert fisher == pytest.approx(C.fisher_seconds(bare, 8, 4, 5))
    # the token estimator counts a row per completion token: its passes follow the completions'
    # mean length (5 or 8 here), its rows' width the longest of a batch (8 in both)
    half = {"max_new_tokens": 16, "rows": 64, "stopped": {"2": 32, "8": 32}, "open": 0}
    full = {"max_new_tokens": 16, "rows": 64, "stopped": {"8": 64}, "open": 0}
    passes = [C.fisher_seconds(C.Sizing(params=10**6, layers=4, hidden=64, a=1e-5, b=2e-11, stops={1.0: [r]}),
                               8, 4, 16, estimator="token")["per-sample passes"]
              - C.Sizing(params=10**6, a=1e-5).calls_s(32 * C.FISHER_ROW_CALLS) for r in (half, full)]
    assert passes[0] / passes[1] == pytest.approx(5 / 8, rel=1e-6)
    # SFT on gold answers samples nothing; on near-policy data it samples `group` a prompt
    assert C.train_seconds(bare, "sft", 3, 4, 4, 16, 8)["steps"] < C.train_seconds(
        bare, "sft", 3, 4, 4, 16, 8, sft_source="self")["steps"]


def test_the_sampler_reports_how_long_each_row_ran(zoo_home, monkeypatch) -> None:
    """Each sampled row's (tokens generated, ended with eos): its completion mask's length, and
    whether its last completion token is eos; a sub-rollout describes no sampling."""
    monkeypatch.setenv("FISHERLENS_HOME", str(zoo_home))
    import torch

    from compute.lm.causal_lm import load_model
    from compute.lm.sampling import sample_completions

    model, tok = load_model("arith-base", device="cpu")
    for new in (2, 12):
        roll = sample_completions(model, tok, ["12+34=", "7+5=", "40+2="], samples=3, max_new_tokens=new, seed=3)
        assert roll.lengths is not None and len(roll.lengths) == len(roll)
        for i, (n, ended) in enumerate(roll.lengths):
            pos = roll.completion_mask[i].nonzero().squeeze(1)
            assert n == len(pos) and 1 <= n <= new
            assert ended == (int(roll.input_ids[i, pos[-1]]) == tok.eos_token_id)
            assert ended or n == new
        assert new == 2 or any(e for _, e in roll.lengths)  # the model answers and ends in 12
        assert roll.select(torch.tensor([0, 1])).lengths is None


def test_the_jobs_that_sample_record_how_long_their_completions_ran(zoo_home, monkeypatch) -> None:
    """A Fisher job records every sampled row once (its tokens: the job's n_tokens), a GRPO run
    every step's rows, near-policy SFT every row it sampled (kept or not), SFT on gold answers
    nothing."""
    monkeypatch.setenv("FISHERLENS_HOME", str(zoo_home))
    from compute.jobs import fisher_run, train_run
    from compute.jobs.fisher import FisherSpec
    from compute.jobs.train import TrainSpec

    res = fisher_run.run(FisherSpec(model="arith-base", prompts=3, samples=2, max_new_tokens=6, shards=2))
    s = res.summary
    rec = s["completion_lengths"]
    assert rec["rows"] == s["n_rows"] == 6 and rec["max_new_tokens"] == 6
    assert sum(int(k) * v for k, v in rec["stopped"].items()) + 6 * rec["open"] == s["n_tokens"]
    base = dict(model="arith-base", steps=2, batch=2, group=3, max_new_tokens=6, eval_prompts=4,
                bound=False, concentration=False)
    for algo, extra, rows in (("grpo", {}, 12), ("sft", {"sft_source": "self"}, 12), ("sft", {}, None)):
        out = train_run.run(TrainSpec(**base, algo=algo, **extra)).summary
        got = out.get("completion_lengths")
        assert (got or {}).get("rows") == rows, (algo, extra, got)


def test_a_result_says_how_long_its_completions_ran_and_warns_when_they_were_cut(zoo_home, monkeypatch) -> None:
    """Every kind's key numbers, from the job's own record: how many completions, their median
    length, and a warning when TRUNCATED_WARN_SHARE or more were cut at max_new_tokens (a Fisher
    of cut completions is not the Fisher of the model's answers). A job whose arithmetic answers
    need 3+ tokens, sampled at 2, is cut almost everywhere; at 12, not."""
    monkeypatch.setenv("FISHERLENS_HOME", str(zoo_home))
    from app.figures.keynumbers import TRUNCATED_WARN_SHARE, completions_item, key_numbers
    from compute.jobs import fisher_run
    from compute.jobs.fisher import FisherSpec

    rec = {"max_new_tokens": 16, "rows": 10, "stopped": {"4": 3, "6": 3}, "open": 4}
    got, warn = completions_item({"summary": {"completion_lengths": rec}})
    assert got == {"label": "Completions", "value": "10 sampled, median 6 tokens", "note": got["note"]}
    assert got["note"].startswith("40% reached max_new_tokens = 16 without ending")
    assert warn is not None and warn.startswith("40% of the sampled completions reached max_new_tokens = 16")
    got, warn = completions_item({"summary": {"completion_lengths": {**rec, "stopped": {"4": 3}, "open": 7}}})
    assert got["value"] == "10 sampled, median at the limit (16 tokens or more)" and warn
    assert completions_item({"summary": {"completion_lengths": {**rec, "stopped": {"4": 10}, "open": 0}}})[1] is None
    assert completions_item({"summary": {"n_rows": 3}}) == (None, None)

    for new, cut in ((2, True), (12, False)):
        res = fisher_run.run(FisherSpec(model="arith-base", prompts=4, samples=2, max_new_tokens=new)).to_dict()
        share = res["summary"]["completion_lengths"]["open"] / 8
        assert (share >= TRUNCATED_WARN_SHARE) == cut, share
        nums = key_numbers(res)
        assert any(i["label"] == "Completions" for i in nums["items"])
        assert any("reached max_new_tokens" in w for w in nums["warnings"]) == cut
