"""Shared test set-up: deterministic seeds, CPU unless a GPU is asked for, a temp FISHERLENS_HOME,
and one real zoo build per test session (cached in a temp folder)."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def pytest_configure(config: pytest.Config) -> None:
    try:
        import torch
    except ImportError:  # pragma: no cover
        return
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    if not torch.cuda.is_available():
        os.environ.setdefault("FISHERLENS_DEVICE", "cpu")


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
    """A FISHERLENS_HOME whose zoo/ holds arith-base and arith-teacher, built once per session.

    Set FISHERLENS_TEST_ZOO to an existing home to reuse a zoo built earlier.
    """
    cached = os.environ.get("FISHERLENS_TEST_ZOO")
    if cached and (Path(cached) / "zoo" / "arith-base").exists():
        return Path(cached)
    from compute.zoo import build_zoo

    home = tmp_path_factory.mktemp("zoo_home")
    build_zoo(home / "zoo")
    return home
