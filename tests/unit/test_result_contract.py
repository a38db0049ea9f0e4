"""The compute -> reader contract (compute/contract/results.py): every kind's real runner on the
tiny zoo produces only declared names and typed summaries, its dict parses, and the figure
registry draws something for it. Plus: old stored results parse, wrong types are refused."""

from __future__ import annotations

import json
import typing

import pytest

from compute.contract import results as C
from compute.contract.jobresult import Heatmap, JobResult, LayerStat, SeriesPoint
from compute.jobs import registry as R
from compute.jobs.diff import UPDATE_SPARSITY
from compute.jobs.retention import RETENTION, RetentionResult
from compute.jobs.sweep import SWEEP
from compute.jobs.train import BOUND_RHS


def test_every_kind_has_a_contract_and_precisions_match_the_spec():
    from compute.contract.specs import PRECISION_DTYPES, Precision

    assert all(R.contract(k) is R.get(k).contract and R.contract(k).kind == k for k in R.NAMES)
    assert all(typing.get_args(R.contract(k).result.model_fields["kind"].annotation) == (k,) for k in R.NAMES)
    assert C.PRECISIONS == typing.get_args(Precision) and set(C.PRECISIONS) == set(PRECISION_DTYPES)


def test_to_dict_refuses_undeclared_names_and_wrong_types():
    ok = JobResult("fisher", {"gini": 0.5, "n_samples": 4}, [LayerStat("w", "q", 0, {"mass": 1.0})],
                   [Heatmap("fisher/mean", ["q"], ["0"], [[1.0]])], [SeriesPoint("concentration", 1.0, 1.0)])
    assert ok.to_dict()["kind"] == "fisher"
    for bad, field in (
        (JobResult("fisher", {}, heatmaps=[Heatmap("fisher/means", ["q"], ["0"], [[1.0]])]), "heatmaps"),
        (JobResult("fisher", {}, series=[SeriesPoint("concentration_curve", 1.0, 1.0)]), "series"),
        (JobResult("mask", {}, layer_stats=[LayerStat("", "q", 0, {}, "layer_module")]), "layer_stats"),
        (JobResult("fisher", {"gini": "0.5"}), "summary.gini"),
        (JobResult("fisher", {"n_samples": 4.0}), "summary.n_samples"),
        (JobResult("sweep", {"points": [{"lr": 1e-3, "optimizer": "sgd"}]}), "summary.points.0.precision"),
        (JobResult("nope", {}), "kind"),
    ):
        with pytest.raises(C.ContractError, match=f"^{field}"):
            bad.to_dict()


def test_old_results_parse_leniently():
    old = {"kind": "retention", "job": {"id": 3}, "summary": {"rows": [
        {"selector": "fisher", "density": 0.1, "retention_mean": 0.9, "retention_std": 0.1, "legacy": 1}],
        "base_reward": 0.2, "something_new": {"a": 1}},
        "series": [{"name": "reward/full", "step": 1, "value": None}],
        "heatmaps": [{"name": "retention", "x_labels": [0.01, 0.1], "y_labels": ["fisher"], "z": [[0.5, None]],
                      "meta": {}}], "layer_stats": [{"param": "w", "module": "q", "layer": 0, "values": {}}]}
    r = R.parse_result(old)
    assert isinstance(r, RetentionResult) and r.summary.rows[0].retention_mean == 0.9
    assert r.raw_summary["something_new"] == {"a": 1} and r.heatmap("retention").x_labels == ["0.01", "0.1"]
    assert r.curve("reward/full") is None and r.job == {"id": 3}
    # kind from the job row (GET /api/results answers both)
    assert R.parse_result({"job": {"kind": "diff"}, "summary": {"unchanged_atol_1e-08": 0.6}}).summary.unchanged() == {
        "atol_1e-08": 0.6}
    with pytest.raises(C.ContractError, match="^summary.rows.0.density"):
        R.parse_result({"kind": "retention", "summary": {"rows": [{"selector": "x", "density": "0.1"}]}})


def test_families_are_exact_prefixes():
    r = R.parse_result({"kind": "retention", "summary": {}, "series": [
        {"name": "retention/fisher", "step": 0.1, "value": 0.9}, {"name": "retention/fisher", "step": 0.01, "value": 0.5},
        {"name": "retentionx/fisher", "step": 1, "value": 1}, {"name": "heldout/random", "step": 1, "value": 0.2}]})
    assert r.curves(RETENTION) == {"fisher": ([0.01, 0.1], [0.5, 0.9])}
    assert RETENTION.part("retention/") is None and UPDATE_SPARSITY.part("update_sparsity_bf16") == "bf16"


# ---------------------------------------------------------------- real runners on the tiny zoo


@pytest.fixture(scope="module")
def runs(zoo_home, tmp_path_factory):
    """One small run of every kind (arith-base, CPU): kind -> JobResult."""
    import os

    from safetensors.torch import save_file

    from compute.jobs import diff_run as run_diff
    from compute.jobs import fisher_run as run_fisher
    from compute.jobs import mask_run as run_mask
    from compute.jobs import retention_run as run_retention
    from compute.jobs import sweep_run as run_sweep
    from compute.jobs import tokens_run as run_tokens
    from compute.jobs import train_run as run_train
    from compute.jobs.diff import DiffSpec
    from compute.jobs.fisher import FisherSpec
    from compute.jobs.mask import MaskSpec
    from compute.jobs.retention import RetentionSpec
    from compute.jobs.sweep import SweepSpec
    from compute.jobs.tokens import TokensSpec
    from compute.jobs.train import TrainSpec

    old = {k: os.environ.get(k) for k in ("FISHERLENS_HOME", "FISHERLENS_DEVICE")}
    os.environ.update(FISHERLENS_HOME=str(zoo_home), FISHERLENS_DEVICE="cpu")
    tmp = tmp_path_factory.mktemp("contract")
    try:
        out = {"fisher": run_fisher.run(FisherSpec(model="arith-base", prompts=4, samples=2, max_new_tokens=4,
                                                   device="cpu"))}
        save_file(out["fisher"].tensors["fisher"], str(tmp / "fisher.safetensors"))
        fisher = str(tmp / "fisher.safetensors")
        out["mask"] = run_mask.run(MaskSpec(fisher=fisher, select="fisher", density=0.1))
        base, tuned = (str(zoo_home / "zoo" / n) for n in ("arith-base", "arith-teacher"))
        out["diff"] = run_diff.run(DiffSpec(base=base, tuned=tuned, fisher=fisher, topk_percent=1.0))
        out["tokens"] = run_tokens.run(TokensSpec(model="arith-base", context="12+34=", top_k=3, random_k=2,
                                                  low_k=2, device="cpu"))
        small = {"steps": 2, "batch": 2, "group": 2, "max_new_tokens": 4, "eval_prompts": 4, "device": "cpu",
                 "fisher_prompts": 2, "fisher_samples": 2}
        out["train"] = run_train.run(TrainSpec(model="arith-base", concentration=True, **small))
        out["sweep"] = run_sweep.run(SweepSpec(model="arith-base", lrs=[1e-3], optimizers=["sgd"],
                                               precision=["bf16-mixed"], **small))
        out["retention"] = run_retention.run(RetentionSpec(
            model="arith-base", densities=[0.1], selectors=["random"], seeds=1, bootstrap=100,
            **{**small, "eval_prompts": 8}))
        # a run folder: two checkpoints of the base's architecture (the teacher, then the base)
        import shutil

        from compute.jobs.series import SeriesSpec
        from compute.jobs.series import run as run_series

        run_dir = tmp / "run"
        shutil.copytree(tuned, run_dir / "checkpoint-1")
        shutil.copytree(base, run_dir / "checkpoint-2")
        out["series"] = run_series(SeriesSpec(base=base, run_dir=str(run_dir), fisher=fisher))
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return out


@pytest.mark.slow
@pytest.mark.parametrize("kind", R.NAMES)
def test_runner_output_matches_its_contract_and_draws(runs, kind):
    from app.figures.registry import figures_for, tables_for

    d = runs[kind].to_dict()  # checks the contract
    stored = json.loads(json.dumps(d, default=str).replace("NaN", "null"))  # as the database gives it back
    r = R.parse_result(stored)
    assert type(r) is R.contract(kind).result and r.kind == kind
    c = R.contract(kind)
    assert {h.name for h in r.heatmaps} <= {*c.heatmaps} | {h.name for f in c.heatmap_families for h in r.heatmaps_in(f)}
    figs = figures_for(r)
    assert figs, kind
    for name, fig in figs:
        assert fig.to_json() and fig.layout.title.text, (kind, name)
    assert ("Summary" in [t for t, _ in tables_for(r)])
    headline = {"fisher": r.summary.top1_share if kind == "fisher" else None,
                "mask": getattr(r.summary, "density", None), "train": getattr(r.summary, "accuracy_after", None),
                "tokens": getattr(r.summary, "entropy", None)}.get(kind, 0.0)
    assert headline is not None


def test_every_declared_heatmap_and_series_is_drawn_by_a_registered_figure():
    """A name a kind declares and no figure reads would be computed and then ignored: a result
    holding only that one heatmap (or series) draws a figure."""
    from app.figures.registry import entries, figures_for

    one = {"x_labels": ["q"], "y_labels": ["0"], "z": [[0.5]], "meta": {}}
    family_examples = {"update_sparsity": "update_sparsity_exact", "retention": "retention/fisher",
                       "heldout": "heldout/fisher", "train_reward": "train_reward/full"}
    family_examples.update({f.prefix: f"{f.prefix}/adamw bf16" for f in SWEEP.values()})
    family_examples.update({"vs_base": "vs_base/unchanged_bf16", "vs_prev": "vs_prev/unchanged_bf16",
                            "sync": "sync/sparse_bytes", "fisher": "fisher/auc_vs_prev"})
    for kind, c in ((k, R.contract(k)) for k in R.NAMES):
        names = [e.name for e in entries(kind)]
        assert len(names) == len(set(names)), kind
        heatmaps = [*c.heatmaps, *(family_examples[f.prefix] for f in c.heatmap_families)]
        for h in heatmaps:
            assert figures_for({"kind": kind, "summary": {}, "heatmaps": [{"name": h, **one}]}), (kind, h)
        series = [*c.series, *(family_examples[f.prefix] for f in c.series_families)]
        for name in series:
            # sweep/<metric>/<run> repeat summary.points (the figures read the points) and bound/rhs
            # is the line sqrt(E[A^2]) sqrt(F) the bound figure draws from the summary's constant
            if kind == "sweep" or name == BOUND_RHS:
                continue
            points = [{"name": name, "step": 1e-3, "value": 0.5}]
            if kind == "series" and name.startswith("fisher/"):
                # the Fisher's AUC per step is drawn in the sync figure, under its byte curves
                points.append({"name": "sync/sparse_bytes", "step": 1e-3, "value": 8.0})
            res = {"kind": kind, "summary": {}, "series": points}
            assert figures_for(res), (kind, name)
