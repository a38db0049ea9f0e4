"""Issue 30 item 5 on a deployment: a job is checked against the memory of the device it will
run on and priced at that device's speed. Workers write what their device offers
(compute/worker/device.py -> the workers table); the web's estimate reads the live rows
(app.ceiling.worker_devices), since the web process has no GPU and never imports torch (it had
compared every job with its own RAM); a direct CLI run uses its own machine (app.ceiling.here)."""

from __future__ import annotations

import json
import shutil
from datetime import timedelta
from pathlib import Path

import pytest

from app import ceiling, limits
from compute.contract.settings import Settings
from compute.contract.specs import SpecError
from storage import workers
from storage.db import make_engine, make_session_factory, upgrade
from storage.models import WorkerDevice, utcnow

ROOT = Path(__file__).resolve().parents[2]
GB = 10**9


@pytest.fixture
def home(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "compute" / "zoo_weights" / "arith-base", tmp_path / "zoo" / "arith-base")
    upgrade(f"sqlite:///{tmp_path / 'fisherlens.db'}")
    ceiling._workers_cache.clear()
    return tmp_path


def _settings(home: Path) -> Settings:
    return Settings(fisherlens_home=home, database_url=None, redis_url=None)


def _write(settings: Settings, name: str, ago_s: float = 0.0, **fields: object) -> None:
    factory = make_session_factory(make_engine(settings.db_url))
    with factory() as s:
        workers.publish(session=s, name=name, **fields)
        if ago_s:
            row = s.get(WorkerDevice, name)
            assert row is not None
            row.seen_at = utcnow() - timedelta(seconds=ago_s)
            s.commit()
    ceiling._workers_cache.clear()


GPU = dict(host="gpu-box", device="cuda:0", device_name="NVIDIA H100 80GB HBM3", total_bytes=80 * GB,
           host_free_bytes=200 * GB, torch_version="2.13.0")


def _estimate(settings: Settings, spec_data: dict) -> tuple[dict, object]:
    from compute.jobs.registry import parse_spec

    spec = parse_spec("fisher", spec_data)
    return limits.estimate(settings, "fisher", spec, limits.refs_for_estimate(settings, "fisher", spec)), spec


def test_a_job_is_checked_against_the_memory_of_the_workers_device(home: Path) -> None:
    """A live worker's row sets the free figure the submit check uses, with its device and
    name in the refusal; the smallest of several (a queued job may land on any); a cpu spec on a
    GPU worker: its host's RAM; a row not seen for LIVE_AFTER_S no longer counts; a direct run
    (here()) uses this machine."""
    settings = _settings(home)
    spec_data = {"model": "arith-base", "prompts": 8, "samples": 2, "max_new_tokens": 16}
    est, spec = _estimate(settings, spec_data)
    need = int(est["memory_bytes"])
    local_free, local_where = limits.free_memory(settings)
    assert local_where == "cpu" and need < local_free  # this machine: fits

    _write(settings, "gpu0@box", free_bytes=need // 2, seconds_per_token_pass=None,
           seconds_per_param_token_pass=None, **GPU)
    assert limits.free_memory(settings) == (need // 2, "cuda:0 of worker gpu0@box")
    assert limits.free_memory(settings, "cpu") == (200 * GB, "cpu of worker gpu0@box")
    with pytest.raises(SpecError) as err:
        limits.check_memory(settings, est, spec)
    (e,) = err.value.errors
    assert e["field"] == "memory" and e["limit"] == need // 2 and e["value"] == est["memory_bytes"]
    assert "cuda:0 of worker gpu0@box has" in e["message"]
    with ceiling.here():  # the same job run by a direct CLI command: this machine's memory
        assert limits.free_memory(settings)[1] == "cpu"
        limits.check_memory(settings, est, spec)

    _write(settings, "gpu0@box", free_bytes=need * 4)
    _write(settings, "gpu1@box", free_bytes=need * 2, **GPU)
    free, where = limits.free_memory(settings)
    assert free == need * 2 and where == "cuda:0 of worker gpu1@box (the smallest of 2 workers' devices)"
    # a GPU worker's figure sizes the job as a GPU job (what it keeps on the host counted apart)
    assert limits.sizing(settings, "fisher", spec, limits.refs_for_estimate(settings, "fisher", spec),
                         est["params"], 0).device_is_gpu
    limits.check_memory(settings, est, spec)  # fits both

    _write(settings, "gpu2@box", ago_s=workers.LIVE_AFTER_S + 5, free_bytes=1, **GPU)  # gone
    assert limits.free_memory(settings)[0] == need * 2


def test_a_job_is_priced_by_the_calibration_the_workers_measured(home: Path) -> None:
    """The workers' own (a, b), the slowest of them, price the estimate, labelled with the
    worker; without any, the reference machine's; a direct run (here()) its own machine's."""
    settings = _settings(home)
    assert ceiling.calibration(settings) is not None and ceiling.calibration(settings)[2] == ceiling.REFERENCE
    _write(settings, "fast@box", free_bytes=10 * GB, seconds_per_token_pass=1e-4,
           seconds_per_param_token_pass=1e-12, **GPU)
    _write(settings, "slow@box", free_bytes=10 * GB, seconds_per_token_pass=2e-4,
           seconds_per_param_token_pass=3e-12, **GPU)
    assert ceiling.calibration(settings) == (2e-4, 3e-12, "worker slow@box, cuda:0")
    got = ceiling.seconds_of(settings, 1000, 1_000_000)
    assert got is not None and got[0] == pytest.approx(1000 * (2e-4 + 3e-12 * 1_000_000))
    assert got[1] == "calibrated (worker slow@box, cuda:0)"
    est, _ = _estimate(settings, {"model": "arith-base", "prompts": 8, "samples": 2, "max_new_tokens": 16})
    assert est["seconds_from"].startswith("calibrated (worker slow@box, cuda:0)")
    assert est["seconds_parts"] and est["seconds"] == pytest.approx(sum(est["seconds_parts"].values()))
    with ceiling.here():
        assert ceiling.calibration(settings)[2] == ceiling.REFERENCE  # type: ignore[index]


def test_the_workers_table_round_trip(home: Path) -> None:
    settings = _settings(home)
    factory = make_session_factory(make_engine(settings.db_url))
    with factory() as s:
        workers.publish(session=s, name="w@h", free_bytes=5, **GPU)
        assert workers.touch(session=s, name="w@h") and not workers.touch(session=s, name="x@h")
        (row,) = workers.live(session=s)
        assert row["name"] == "w@h" and row["free_bytes"] == 5 and row["device"] == "cuda:0"
        workers.publish(session=s, name="w@h", free_bytes=7)  # the fields not given are kept
        (row,) = workers.live(session=s)
        assert row["free_bytes"] == 7 and row["device_name"] == GPU["device_name"]
        with pytest.raises(ValueError, match="fields: \\['gpu'\\] are not columns of workers"):
            workers.publish(session=s, name="w@h", gpu=1)
        workers.remove(session=s, name="w@h")
        assert workers.live(session=s) == []


def test_a_worker_describes_its_own_device(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """compute/worker/device.py on this machine: the device a job on auto runs on, what a job may
    take there (MAX_JOB_MEMORY_MB less what the process holds, when set), and the home's
    calibration only when it was measured on the same kind of device."""
    from compute.worker import device

    monkeypatch.setenv("MAX_JOB_MEMORY_MB", "4096")
    settings = Settings(fisherlens_home=home, database_url=None, redis_url=None, max_job_memory_mb=4096)
    got = device.profile(settings)
    assert got["device"] == "cpu" and got["host_free_bytes"] is None
    assert 0 < got["free_bytes"] <= 4096 * 2**20 and got["total_bytes"] > got["free_bytes"]
    assert got["seconds_per_token_pass"] is None  # no calibration in this home
    (home / "throughput.json").write_text(json.dumps(
        {"seconds_per_token_pass": 1e-5, "seconds_per_param_token_pass": 2e-11, "device": "cuda:0"}))
    assert device.profile(settings)["seconds_per_token_pass"] is None  # measured on a GPU, not here
    (home / "throughput.json").write_text(json.dumps(
        {"seconds_per_token_pass": 1e-5, "seconds_per_param_token_pass": 2e-11, "device": "cpu"}))
    got = device.profile(settings)
    assert (got["seconds_per_token_pass"], got["seconds_per_param_token_pass"]) == (1e-5, 2e-11)
    device.publish(settings, "me@here")
    ceiling._workers_cache.clear()
    (row,) = ceiling.worker_devices(Settings(fisherlens_home=home, database_url=None, redis_url=None))
    assert row["name"] == "me@here" and 0 < row["free_bytes"] <= 4096 * 2**20
    assert (row["seconds_per_token_pass"], row["device"]) == (1e-5, "cpu")


def test_the_workers_listing_says_what_a_queued_job_meets_through_api_cli_and_ui(
        home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """GET /api/workers, `fisherlens workers` and the Jobs tab's table list the live workers (a
    stale one left out) and state the same figures submit uses: the smallest free memory (a queued
    job may run on any; a cpu spec on a GPU worker: its host's RAM) and the slowest calibration;
    with no worker they say jobs wait, and this machine's memory applies."""
    from click.testing import CliRunner
    from fastapi.testclient import TestClient

    from app import services
    from app.cli import main
    from app.ui.jobs import workers_view
    from app.web import create_app

    settings = _settings(home)
    empty = services.workers(settings)
    assert empty["workers"] == [] and empty["note"].startswith("no live worker: queued jobs wait")
    assert empty["checked_against"]["auto"]["where"] == "cpu"  # this machine, as submit says
    assert "reference machine's calibration" in empty["priced_by"]["where"]

    _write(settings, "gpu0@box", free_bytes=60 * GB, seconds_per_token_pass=0.002,
           seconds_per_param_token_pass=3e-12, **GPU)
    _write(settings, "gpu1@box", free_bytes=70 * GB, seconds_per_token_pass=0.004,
           seconds_per_param_token_pass=2e-12, **{**GPU, "host_free_bytes": 150 * GB})
    _write(settings, "old@box", ago_s=workers.LIVE_AFTER_S + 5, free_bytes=1 * GB,
           seconds_per_token_pass=1.0, seconds_per_param_token_pass=1e-9, **GPU)
    out = services.workers(settings)
    assert [w["name"] for w in out["workers"]] == ["gpu0@box", "gpu1@box"]  # old@box is stale
    w0 = out["workers"][0]
    assert (w0["device"], w0["free_bytes"], w0["total_bytes"]) == ("cuda:0", 60 * GB, 80 * GB)
    assert w0["calibration"] == {"seconds_per_token_pass": 0.002, "seconds_per_param_token_pass": 3e-12}
    assert 0 <= w0["seen_seconds_ago"] < 60
    assert out["checked_against"]["auto"] == {
        "free_bytes": 60 * GB, "where": "cuda:0 of worker gpu0@box (the smallest of 2 workers' devices)"}
    assert out["checked_against"]["cpu"]["free_bytes"] == 150 * GB
    # the slowest per parameter (3e-12 > 2e-12): gpu0, as the estimate prices it
    assert out["priced_by"] == {"seconds_per_token_pass": 0.002, "seconds_per_param_token_pass": 3e-12,
                                "where": "calibrated (worker gpu0@box, cuda:0)"}
    assert out["note"].startswith("2 live workers")
    assert limits.free_memory(settings) == (out["checked_against"]["auto"]["free_bytes"],
                                            out["checked_against"]["auto"]["where"])

    r = TestClient(create_app(settings), base_url="http://127.0.0.1").get("/api/workers")
    assert r.status_code == 200
    body = r.json()
    assert [w["name"] for w in body["workers"]] == ["gpu0@box", "gpu1@box"]
    assert body["checked_against"] == out["checked_against"] and body["priced_by"] == out["priced_by"]

    monkeypatch.setenv("FISHERLENS_HOME", str(home))
    monkeypatch.delenv("FISHERLENS_URL", raising=False)
    monkeypatch.delenv("DATABASE_URL", raising=False)
    res = CliRunner().invoke(main, ["workers", "--json"])
    assert res.exit_code == 0, res.output
    assert [w["name"] for w in json.loads(res.output)["workers"]] == ["gpu0@box", "gpu1@box"]
    res = CliRunner().invoke(main, ["workers"])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert lines[0].split()[:2] == ["worker", "device"]
    assert lines[1].startswith("gpu0@box") and "60 GB" in lines[1] and "80 GB" in lines[1]
    assert "checked against: 60 GB (cuda:0 of worker gpu0@box" in res.output
    assert "calibrated (worker gpu0@box, cuda:0)" in res.output

    html = workers_view(settings)
    assert html.count("<tr data-worker=") == 2 and "old@box" not in html
    assert "<b>60 GB</b> (cuda:0 of worker gpu0@box" in html

    # a CPU worker beside the GPU ones: every queued job is sized for it, and the listing says so
    _write(settings, "cpu@web", free_bytes=20 * GB, seconds_per_token_pass=None, seconds_per_param_token_pass=None,
           host="web", device="cpu", device_name="x86_64", total_bytes=32 * GB, host_free_bytes=None,
           torch_version="2.13.0")
    out = services.workers(settings)
    assert out["checked_against"]["auto"]["where"].startswith("cpu of worker cpu@web")
    assert out["note"].startswith("3 live workers on different kinds of device (cpu, cuda)")
    assert "(worker cpu@web, cpu)" in out["note"] and "stop the workers a job should not land on" in out["note"]
