"""Reliability travels (issue 18): a Fisher's split-half verdict is stored with its file (through
storage, on SQLite and PostgreSQL) and read back by what is built on it; `until_reliable` adds
prompts until the verdict is fair, and is the same Fisher as asking for that many prompts at once;
one spec call (`FisherSpec.more_samples`) and one CLI flag rerun with more samples."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from compute.contract.jobresult import JobResult
from compute.contract.results import FAIR_JACCARD, reliability_level
from compute.jobs.artifact_files import fisher_provenance, stored_metadata
from compute.jobs.fisher import FisherSpec
from tests.pg import pg_schema_url


@pytest.fixture
def zoo_env(zoo_home) -> Iterator[None]:
    keys = ("FISHERLENS_HOME", "FISHERLENS_DEVICE")
    old = {k: os.environ.get(k) for k in keys}
    os.environ.update(FISHERLENS_HOME=str(zoo_home), FISHERLENS_DEVICE="cpu")
    yield
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


TINY = {"model": "arith-base", "samples": 2, "max_new_tokens": 4, "device": "cpu", "exact_output": False}


def test_until_reliable_is_the_fisher_of_the_prompts_it_reached(zoo_env):
    """2 prompts are far from 'fair': the job doubles them (rounds recorded, each with its
    Jaccard) up to max_prompts; the Fisher equals a plain run on that many prompts, inline and
    through the worker's children/combine path."""
    from compute.jobs import fisher_run as run_fisher

    spec = FisherSpec(**TINY, prompts=2, until_reliable=True, max_prompts=8)
    got = run_fisher.run(spec)
    rounds = got.summary["until_reliable"]
    assert [r["prompts"] for r in rounds["rounds"]][0] == 2 and rounds["prompts_asked"] == 2
    used = rounds["prompts_used"]
    assert used == rounds["rounds"][-1]["prompts"] and used in (2, 4, 8)
    for r in rounds["rounds"][:-1]:
        assert r["split_half_jaccard"] < FAIR_JACCARD  # it only went on while below fair
    assert got.summary["n_prompts"] == used
    assert got.summary["split_half_jaccard"] == pytest.approx(rounds["rounds"][-1]["split_half_jaccard"])
    plain = run_fisher.run(FisherSpec(**TINY, prompts=used))
    for n, t in plain.tensors["fisher"].items():
        torch.testing.assert_close(got.tensors["fisher"][n], t, rtol=1e-5, atol=0)
    # the fan-out path: children of the asked spec, then combine (which extends in its worker)
    outs = [run_fisher.run_child(spec, i) for i in range(run_fisher.children(spec))]
    combined = run_fisher.combine(spec, outs)
    assert combined.summary["until_reliable"]["prompts_used"] == used
    for n, t in plain.tensors["fisher"].items():
        torch.testing.assert_close(combined.tensors["fisher"][n], t, rtol=1e-5, atol=0)
    # the stored file says how reliable it is
    meta = json.loads(got.metadata["fisher"]["fisherlens"])
    assert meta["reliability"] == reliability_level(got.summary["split_half_jaccard"])
    assert meta["compute_dtype"] == "float32" and meta["n_prompts"] == used


def test_more_samples_is_a_spec_with_until_reliable_and_more_prompts():
    s = FisherSpec(model="arith-base", prompts=16)
    more = s.more_samples()
    assert more.until_reliable and more.prompts == 64 and more.max_prompts >= 64
    assert more.model_dump() | {"prompts": 16, "until_reliable": False, "max_prompts": s.max_prompts} == s.model_dump()
    assert FisherSpec(model="arith-base", prompts=4000).more_samples().prompts == 4096


def test_default_fisher_spec_is_the_measured_fair_setting():
    s = FisherSpec(model="arith-base")
    assert (s.prompts, s.samples, s.dtype, s.until_reliable) == (64, 4, "float32", False)


def test_cli_has_the_until_reliable_flag():
    from click.testing import CliRunner

    from app.commands.fisher import fisher

    out = CliRunner().invoke(fisher, ["--help"]).output
    assert "--until-reliable" in out and "--max-prompts" in out


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def session(request: pytest.FixtureRequest, tmp_path: Path):
    from storage.db import make_engine, make_session_factory, upgrade

    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'fl.db'}"
        cm = None
    else:
        cm = pg_schema_url("fl_rel")
        url = cm.__enter__()
    upgrade(url)
    engine = make_engine(url)
    with make_session_factory(engine)() as s:
        yield s
    engine.dispose()
    if cm is not None:
        cm.__exit__(None, None, None)


def test_fisher_verdict_travels_through_storage_to_a_mask(session, tmp_path):
    """save_result writes the Fisher's metadata into its artifact; a mask built on that file shows
    the verdict, and so does the mask's own file (what a train job on it reads)."""
    from compute.jobs import mask_run as run_mask
    from compute.jobs.fisher_run import fisher_metadata
    from compute.jobs.mask import MaskSpec
    from storage import repo
    from storage.artifacts import ArtifactStore

    summary = {"estimator": "sequence", "split_half_jaccard": 0.62, "split_half_topk_percent": 1.0,
               "n_prompts": 64, "compute_dtype": "float32", "accumulate_dtype": "float32"}
    fisher = {"a.weight": torch.rand(8, 4), "b.weight": torch.rand(4)}
    result = JobResult(kind="fisher", summary=summary, tensors={"fisher": fisher},
                       metadata={"fisher": fisher_metadata(summary)})
    store = ArtifactStore(tmp_path / "artifacts")
    job = repo.create_job(session=session, kind="fisher", spec={}, spec_hash="rel")
    repo.save_result(session=session, job_id=job.id, result=result, store=store)
    path = store.resolve(repo.get_artifact(session=session, job_id=job.id, kind="fisher").path)
    rel = fisher_provenance(str(path))
    assert rel["split_half_jaccard"] == 0.62 and rel["reliability"] == "fair" and rel["source"] == str(path)
    mask = run_mask.run(MaskSpec(fisher=str(path), select="fisher", density=0.25))
    assert mask.summary["fisher_reliability"]["split_half_jaccard"] == 0.62
    mfile = tmp_path / "mask.safetensors"
    from safetensors.torch import save_file

    save_file(mask.tensors["mask"], str(mfile), metadata=mask.metadata["mask"])
    assert "fisher_reliability" in stored_metadata(str(mfile), "mask")
    assert fisher_provenance(str(mfile), "mask")["reliability"] == "fair"


def test_a_fisher_file_without_metadata_says_its_reliability_is_unknown(tmp_path):
    from safetensors.torch import save_file

    save_file({"w": torch.ones(3)}, str(tmp_path / "fisher.safetensors"))
    rel = fisher_provenance(str(tmp_path / "fisher.safetensors"))
    assert rel["reliability"] == "none" and "unknown" in rel["note"]
    from app.figures.keynumbers import key_numbers

    v = key_numbers({"kind": "mask", "summary": {"fisher_reliability": rel}})["verdict"]
    assert v["level"] == "none" and "unknown" in v["text"]
