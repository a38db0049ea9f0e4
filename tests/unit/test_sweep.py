"""The `sweep` job: lr x optimizer x precision grid of train + diff runs, from the spec to the
figures, through the CLI and through a real job (SQLite, the worker's execute_job)."""

from __future__ import annotations

import json
import math
import shutil

import pytest

from compute.contract.specs import SpecError
from compute.jobs.registry import parse_spec


def test_sweep_spec_validation_names_the_field() -> None:
    s = parse_spec("sweep", {"model": "arith-base"})
    assert s.lrs == [1e-6, 1e-5, 1e-4, 1e-3] and s.optimizers == ["adamw", "sgd"]
    assert s.precision == ["bf16-mixed"]
    for data, field in (({"lrs": [1e-6, 1e-6]}, "lrs"), ({"lrs": [0.0]}, "lrs"),
                        ({"optimizers": ["adam"]}, "optimizers"), ({"precision": ["fp16"]}, "precision"),
                        ({"algo": "opd"}, "teacher"), ({"lrs": [i * 1e-6 + 1e-6 for i in range(16)],
                                                        "precision": ["fp32", "bf16"]}, "lrs")):
        with pytest.raises(SpecError) as exc:
            parse_spec("sweep", {"model": "arith-base", **data})
        assert field in str(exc.value), (data, str(exc.value))


def test_grid_order_and_point_specs() -> None:
    from compute.jobs.sweep_run import grid, point_spec

    s = parse_spec("sweep", {"model": "arith-base", "lrs": [1e-6, 1e-3], "optimizers": ["sgd", "adamw"],
                             "precision": ["fp32", "bf16"], "steps": 3, "seed": 7})
    g = grid(s)
    assert len(g) == 8 and g[0] == ("fp32", "sgd", 1e-6) and g[-1] == ("bf16", "adamw", 1e-3)
    t = point_spec(s, "bf16", "adamw", 1e-3)
    assert (t.precision, t.optimizer, t.lr, t.steps, t.seed, t.bound, t.concentration) == \
        ("bf16", "adamw", 1e-3, 3, 7, False, True)


def test_sweep_cost_counts_every_point() -> None:
    from app.limits import token_passes

    one = token_passes("sweep", parse_spec("sweep", {"model": "m", "lrs": [1e-6], "optimizers": ["sgd"]}))
    four = token_passes("sweep", parse_spec("sweep", {"model": "m", "lrs": [1e-6, 1e-5],
                                                      "optimizers": ["sgd", "adamw"]}))
    train = token_passes("train", parse_spec("train", {"model": "m", "steps": 20, "bound": False}))
    assert one > 0 and four > 3 * one and one == pytest.approx(train, rel=1e-9)


def _points() -> list[dict]:
    rows = []
    for opt in ("adamw", "sgd"):
        for lr, un in ((1e-6, 0.98), (1e-3, 0.1 if opt == "adamw" else 0.9)):
            rows.append({"lr": lr, "optimizer": opt, "precision": "bf16-mixed", "unchanged_bf16": un,
                         "unchanged_bf16delta_atol_1e-05": un, "fisher_auc_changed": 0.6,
                         "fisher_auc_changed_within_binades": 0.7, "fisher_auc_gradient": 0.95,
                         "fisher_auc_changed_by_binade": [
                             {"exponent": -6, "abs_w_lo": 2**-7, "abs_w_hi": 2**-6, "n": 10, "n_changed": 3,
                              "auc": 0.8},
                             {"exponent": -1000, "abs_w_lo": 0.0, "abs_w_hi": 0.0, "n": 2, "n_changed": 0,
                              "auc": None}]})
    return rows


def test_sweep_figures_and_markdown() -> None:
    from app.plots import (
        result_figures,
        sweep_auc_figure,
        sweep_binade_figure,
        sweep_sparsity_figure,
    )
    from compute.jobs.sweep_run import markdown_table

    result = {"kind": "sweep", "summary": {"points": _points()}, "heatmaps": [], "series": []}
    names = [n for n, _ in result_figures(result)]
    assert names[:3] == ["sweep_sparsity", "sweep_auc", "sweep_binades"]
    fig = sweep_sparsity_figure(result)
    lines = {t.name: list(t.y) for t in fig.data}
    assert lines["adamw bf16-mixed: bf16-equal"] == [0.98, 0.1]  # sorted by lr
    assert lines["sgd bf16-mixed: bf16-equal"] == [0.98, 0.9]
    assert len(sweep_auc_figure(result).data) == 6  # 3 AUCs x 2 optimizer lines
    binades = sweep_binade_figure(result)
    assert len(binades.data) == 4 and list(binades.data[0].x) == [2**-7]  # w == 0 bin left out
    from app.plots import result_tables

    tables = dict(result_tables(result))
    headers, rows = tables["Sweep points (lr x optimizer x precision)"]
    assert len(rows) == 4 and headers[:4] == ["precision", "optimizer", "lr", "unchanged_bf16"]
    assert rows[0][:4] == ["bf16-mixed", "adamw", 1e-6, 0.98]
    md = markdown_table(_points())
    assert md.count("\n") == 2 + 4 and "| bf16-mixed | adamw | 1e-06 | 0.980 |" in md
    import re

    cells = [len(re.split(r"(?<!\\)\|", line)) for line in md.splitlines()]
    assert len(set(cells)) == 1  # pipes inside headers are escaped: every row has the same columns


@pytest.mark.slow
def test_sweep_cli_on_zoo_shows_precision_sparsity(zoo_home, tmp_path, monkeypatch) -> None:
    """bf16-mixed at lr 1e-6 leaves most stored weights bit-identical; lr 1e-2 changes most."""
    from click.testing import CliRunner

    from app.commands.training import sweep_cmd

    monkeypatch.setenv("FISHERLENS_HOME", str(zoo_home))
    out = tmp_path / "sw"
    args = ["--model", "arith-base", "--lrs", "1e-6,1e-2", "--optimizers", "adamw", "--precision", "bf16-mixed",
            "--steps", "2", "--batch", "2", "--group", "2", "--max-new-tokens", "4", "--eval-prompts", "10",
            "--fisher-prompts", "4", "--fisher-samples", "2", "--device", "cpu", "--out", str(out)]
    res = CliRunner().invoke(sweep_cmd, args)
    assert res.exit_code == 0, res.output
    data = json.loads((out / "sweep.json").read_text())
    pts = {p["lr"]: p for p in data["points"]}
    assert set(pts) == {1e-6, 1e-2}
    for p in pts.values():
        assert p["precision"] == "bf16-mixed" and p["optimizer"] == "adamw" and p["stored_dtype"] == "bfloat16"
        assert 0 <= p["reward_before"] <= 1 and 0 <= p["reward_after"] <= 1
        assert 0 <= p["fisher_auc_gradient"] <= 1
    assert pts[1e-6]["unchanged_bf16"] >= 0.5
    assert pts[1e-2]["unchanged_bf16"] < 0.5 * pts[1e-6]["unchanged_bf16"]
    assert 0 <= pts[1e-2]["fisher_auc_changed"] <= 1
    assert data["summary"]["initial_fisher"]["source"] == "other-prompts"
    assert data["command"].startswith("fisherlens sweep --model arith-base ") and " --lrs 1e-06,0.01 " in data["command"]
    weights = data["provenance"]["models"]["arith-base"]["sha256"]["model.safetensors"]
    assert weights == data["model_weights_sha256"] and data["provenance"]["command"] == data["command"]
    assert len(data["model_weights_sha256"]) == 64
    assert (out / "sweep.md").read_text() == data["summary"]["markdown"]
    assert (out / "sweep.html").is_file()


def test_sweep_cli_bad_values_exit_2(tmp_path, fl_home) -> None:
    from click.testing import CliRunner

    from app.commands.training import sweep_cmd

    for args, flag in ((["--lrs", "1e-6,x"], "--lrs"), (["--optimizers", "adam"], "--optimizers"),
                       (["--precision", "fp8"], "--precision"), (["--steps", "0"], "--steps")):
        res = CliRunner().invoke(sweep_cmd, ["--model", "arith-base", *args, "--out", str(tmp_path)])
        assert res.exit_code == 2, res.output
        assert flag in res.output and len(res.output.strip().splitlines()) == 1, res.output


@pytest.mark.slow
def test_sweep_job_through_the_api_and_the_worker(zoo_home, tmp_path, monkeypatch) -> None:
    """POST /api/jobs kind 'sweep' -> queued; the worker fans it out (one child job per point) and
    combines; the stored result has one point per grid cell and the sweep figures."""
    from fastapi.testclient import TestClient

    from app import services
    from app.plots import result_figures
    from app.web import create_app
    from compute.contract.settings import Settings
    from compute.worker import execute_finish, execute_job, execute_shard
    from storage import repo

    home = tmp_path / "home"
    shutil.copytree(zoo_home / "zoo" / "arith-base", home / "zoo" / "arith-base")
    monkeypatch.setenv("FISHERLENS_HOME", str(home))
    monkeypatch.delenv("DATABASE_URL", raising=False)
    monkeypatch.delenv("REDIS_URL", raising=False)
    settings = Settings(fisherlens_home=home, database_url=None, redis_url=None, public_url="http://testserver")
    client = TestClient(create_app(settings), follow_redirects=False)
    bad = client.post("/api/jobs", json={"kind": "sweep", "spec": {"model": "arith-base", "lrs": [1e-6, -1]}})
    assert bad.status_code == 422 and "lrs" in bad.text
    spec = {"model": "arith-base", "lrs": [1e-6, 1e-2], "optimizers": ["sgd"], "precision": ["bf16"],
            "steps": 2, "batch": 2, "group": 2, "max_new_tokens": 4, "eval_prompts": 8,
            "fisher_prompts": 4, "fisher_samples": 2, "device": "cpu"}
    r = client.post("/api/jobs", json={"kind": "sweep", "spec": spec})
    assert r.status_code == 201, r.text
    job = r.json()
    # two points: two child jobs (compute/jobs/runners.py's protocol), one per point, then one combine
    assert execute_job(settings, job["id"]) == "fanned out 2 children"
    with services.sessions(settings)() as s:
        kids = [c.id for c in repo.shard_jobs(session=s, parent_id=job["id"])]
    assert len(kids) == 2
    for kid in reversed(kids):
        assert execute_shard(settings, kid) == "succeeded"
    assert execute_finish(settings, job["id"]) == "succeeded"
    res = client.get(f"/api/results/{job['share_token']}").json()
    assert res["kind"] == "sweep" and len(res["summary"]["points"]) == 2
    for p in res["summary"]["points"]:
        assert p["precision"] == "bf16" and p["optimizer"] == "sgd"
        assert p["unchanged_bf16"] is None or 0 <= p["unchanged_bf16"] <= 1
        assert not (isinstance(p["unchanged_exact"], float) and math.isnan(p["unchanged_exact"]))
    assert [n for n, _ in result_figures(res)][:3] == ["sweep_sparsity", "sweep_auc", "sweep_binades"]


def _as_shipped(output: object) -> object:
    """A unit's output as a worker ships it to the parent (the worker's own dump/load)."""
    from compute.jobs.runners import dump_output, load_output

    return load_output(dump_output(output))


def _comparable(result: object) -> dict:
    d = json.loads(json.dumps(result.to_dict(), default=str))  # type: ignore[attr-defined]
    for p in d["summary"]["points"]:
        p.pop("seconds")
    d["summary"].pop("seconds")
    d["summary"].pop("seconds_parts")
    d["summary"].pop("markdown")  # holds no seconds, but is checked through the points
    return d


@pytest.mark.slow
def test_sweep_units_run_apart_combine_to_the_in_process_run(zoo_home, monkeypatch) -> None:
    """Each point as a child job would run it (own process state, its own Fisher estimate, output
    through torch.save / weights-only load, any order) combines to the in-process sweep: the
    Fisher estimate is deterministic, so every unit computes the same one."""
    import torch

    from compute.jobs.sweep_run import children, combine, initial_fisher, run, run_child

    monkeypatch.setenv("FISHERLENS_HOME", str(zoo_home))
    spec = parse_spec("sweep", {"model": "arith-base", "lrs": [1e-6, 1e-2], "optimizers": ["sgd"],
                                "precision": ["bf16-mixed"], "steps": 1, "batch": 2, "group": 2,
                                "max_new_tokens": 4, "eval_prompts": 8, "fisher_prompts": 4,
                                "fisher_samples": 2, "device": "cpu"})
    assert children(spec) == 2
    whole = run(spec)
    outputs = {i: _as_shipped(run_child(spec, i)) for i in reversed(range(children(spec)))}
    assert outputs[1]["fisher"] is None  # only unit 0 carries the Fisher to the parent
    apart = combine(spec, [outputs[i] for i in range(2)])
    assert _comparable(apart) == _comparable(whole)
    fisher, info = initial_fisher(spec)
    assert info["base_rounded_to_bf16"] and info["source"] == "other-prompts"
    assert set(apart.tensors["fisher"]) == set(fisher)
    for name, f in fisher.items():
        assert torch.equal(apart.tensors["fisher"][name], f) and torch.equal(whole.tensors["fisher"][name], f)
    p_lo, p_hi = apart.summary["points"]
    assert (p_lo["lr"], p_hi["lr"]) == (1e-6, 1e-2)
    assert p_lo["stored_dtype"] == p_hi["stored_dtype"] == "bfloat16"
    # where the time went, by the estimate's own parts (compute.jobs.sweep.timing): the initial
    # Fisher once (the unit that made it), each point's train parts, together the units' time
    from compute.contract.cost import Sizing
    from compute.jobs.sweep import timing

    took = whole.summary["seconds_parts"]
    assert set(took) <= set(timing(spec, Sizing(params=10**5))), took
    assert {"initial Fisher", "load", "steps", "evaluation", "finish"} <= set(took)
    assert all(v > 0 for v in took.values()), took
    assert sum(took.values()) == pytest.approx(whole.summary["seconds"], rel=0.02, abs=0.1)
    assert apart.summary["seconds_parts"]["initial Fisher"] > 0  # each unit made its own
    # how long every point's sampled completions ran, one record (2 points x 1 step x 2 x 2 rows)
    rec = whole.summary["completion_lengths"]
    assert rec["rows"] == 2 * 1 * 2 * 2 and rec["max_new_tokens"] == 4
    assert apart.summary["completion_lengths"] == rec
    with pytest.raises(ValueError, match="index"):
        run_child(spec, 2)
    with pytest.raises(ValueError, match="outputs"):
        combine(spec, [outputs[1], outputs[0]])  # out of grid order
    with pytest.raises(ValueError, match="outputs"):
        combine(spec, [outputs[0]])
