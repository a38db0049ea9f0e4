"""Shared test set-up: deterministic seeds, CPU unless a GPU is asked for, a temp FISHERLENS_HOME,
one real zoo build per test session (cached in a temp folder), and `require_service` (a missing
Redis, PostgreSQL or Chromium is a skip on a laptop and a failure under CI)."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# `fisherlens up` would calibrate the cost model in the background in every fresh home: the
# calibration has its own test (tests/unit/test_calibrate.py)
os.environ.setdefault("CALIBRATE_ON_UP", "false")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _own_redis_db() -> None:
    """Under pytest-xdist each test process gets its own Redis database (gw0: the given one,
    gw1: one below, ...), so counters keyed by address or account (the sign-in throttle) never
    mix between tests running at the same time. PostgreSQL needs nothing: every test uses a
    fresh schema (tests/pg.py), and every stack its own queue name."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    url = os.environ.get("FISHERLENS_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
    base, _, db = url.rpartition("/")
    if worker.startswith("gw") and worker[2:].isdigit() and db.isdigit():
        os.environ["FISHERLENS_TEST_REDIS_URL"] = f"{base}/{(int(db) - int(worker[2:])) % 16}"


_own_redis_db()


def services_required() -> bool:
    """CI=true (or FISHERLENS_REQUIRE_SERVICES=1): every service the suite uses must be there."""
    ci = os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")
    return ci or os.environ.get("FISHERLENS_REQUIRE_SERVICES", "").strip() == "1"


def require_service(reason: str) -> None:
    """Call where a test finds a service (Redis, PostgreSQL, Chromium) missing: a skip with the
    reason on a developer machine, a failure under CI, so CI cannot pass on skipped tests."""
    if services_required():
        pytest.fail(f"{reason} (required: CI=true or FISHERLENS_REQUIRE_SERVICES=1)", pytrace=False)
    pytest.skip(reason)


def pytest_configure(config: pytest.Config) -> None:
    try:
        import torch
    except ImportError:  # pragma: no cover
        return
    # Under pytest-xdist (./dev test) the cores are shared by the test processes: one thread
    # each unless there are more cores than processes.
    procs = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // procs)))
    if not torch.cuda.is_available():
        os.environ.setdefault("FISHERLENS_DEVICE", "cpu")


def _burn() -> None:  # pragma: no cover - runs in a child process
    x = 0
    while True:
        x = (x * 1103515245 + 12345) & 0xFFFFFFFF


@pytest.fixture(scope="session", autouse=True)
def _cpu_burner() -> Iterator[None]:
    """FISHERLENS_TEST_CPU_BURN=N: N busy processes for the whole run, to check that no test
    depends on the machine being quiet (or fast): `FISHERLENS_TEST_CPU_BURN=4 ./dev test`."""
    n = int(os.environ.get("FISHERLENS_TEST_CPU_BURN", "0") or 0)
    if n <= 0:
        yield
        return
    import multiprocessing

    procs = [
        multiprocessing.get_context("spawn").Process(target=_burn, daemon=True) for _ in range(n)
    ]
    for p in procs:
        p.start()
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.join(timeout=10)


@pytest.fixture(autouse=True)
def _seed_everything() -> None:
    random.seed(0)
    try:
        import numpy as np

        np.random.seed(0)
    except ImportError:  # pragma: no cover
        pass
    try:
        import torch

        torch.manual_seed(0)
    except ImportError:  # pragma: no cover
        pass


@pytest.fixture
def fl_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh FISHERLENS_HOME for one test (SQLite + filesystem queue + artifacts)."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("FISHERLENS_HOME", str(home))
    monkeypatch.delenv("DATABASE_URL", raising=False)
    monkeypatch.delenv("REDIS_URL", raising=False)
    return home


@pytest.fixture(scope="session")
def zoo_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A FISHERLENS_HOME whose zoo/ holds every zoo model (the shipped weights, installed and
    sha256-verified once per session: about a second).

    Set FISHERLENS_TEST_ZOO to an existing home to reuse a zoo built earlier.
    """
    from compute.contract.modelref import ZOO_NAMES

    cached = os.environ.get("FISHERLENS_TEST_ZOO")
    if cached and all((Path(cached) / "zoo" / n / "config.json").exists() for n in ZOO_NAMES):
        return Path(cached)
    from compute.zoo import build_zoo

    home = tmp_path_factory.mktemp("zoo_home")
    build_zoo(home / "zoo")
    return home


def shared_real_home(tmp_path_factory: pytest.TempPathFactory, name: str, cached_env: str) -> Path:
    """A FISHERLENS_HOME whose zoo holds real model `name`, converted once per test run: under
    pytest-xdist the test processes share the run's temp root and take turns on a file lock, so
    a module whose tests are spread over several processes still converts once (Gemma 3 270M:
    a minute or two of CPU). The tests only read it. `cached_env` names a variable that may
    point at a home where `fisherlens zoo add NAME` already ran."""
    from filelock import FileLock

    from compute.zoo import add_real_model
    from compute.zoo.folders import is_built

    cached = os.environ.get(cached_env)
    if cached and is_built(Path(cached) / "zoo" / name):
        return Path(cached)
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    home = root / f"real-{name}"
    with FileLock(str(root / f"real-{name}.lock")):
        if not is_built(home / "zoo" / name):
            add_real_model(home / "zoo", name)
    return home
