"""Integration set-up: a real `fisherlens worker` process (Celery, solo pool) per worker name,
against the embedded filesystem queue + SQLite, or real Redis + PostgreSQL (skipped with the
reason when a service is not reachable). Each test gets its own home, queue name and DB schema."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
REDIS_URL = os.environ.get("FISHERLENS_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
PG_URL = os.environ.get(
    "FISHERLENS_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
FINAL = ("succeeded", "failed", "cancelled")


def _redis_or_skip() -> None:
    try:
        import redis

        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2).ping()
    except Exception as exc:  # noqa: BLE001
        pytest.skip(
            f"Redis not reachable at {REDIS_URL} ({type(exc).__name__}); set FISHERLENS_TEST_REDIS_URL"
        )


def _pg_schema() -> Iterator[str | None]:
    """A fresh PostgreSQL schema URL, or None (then SQLite) when PostgreSQL is unreachable."""
    from sqlalchemy import text

    from storage.db import make_engine

    try:
        admin = make_engine(PG_URL, connect_args={"connect_timeout": 3})
        with admin.connect() as conn:
            conn.execute(text("SELECT 1"))
    except Exception:  # noqa: BLE001
        yield None
        return
    schema = f"fl_it_{secrets.token_hex(6)}"
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    sep = "&" if "?" in PG_URL else "?"
    try:
        yield f"{PG_URL}{sep}options=-csearch_path%3D{schema}"
    finally:
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        admin.dispose()


@dataclass
class Worker:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def wait_ready(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.log.read_text(errors="replace") if self.log.exists() else ""
            if f"{self.name} ready." in text:
                return
            if self.proc.poll() is not None:
                raise AssertionError(f"worker {self.name} exited early:\n{text[-3000:]}")
            time.sleep(0.2)
        raise AssertionError(
            f"worker {self.name} not ready after {timeout}s:\n{self.log.read_text()[-3000:]}"
        )

    def kill(self) -> None:
        """SIGKILL: no clean-up of any kind (like an OOM kill or a lost machine)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()


@dataclass
class Stack:
    """One isolated deployment: home (zoo linked in), DB, broker, queue; workers on demand."""

    kind: str
    home: Path
    env: dict[str, str]
    workers: list[Worker] = field(default_factory=list)

    @property
    def settings(self) -> Any:
        from app.settings import Settings

        return Settings(
            fisherlens_home=self.home,
            database_url=self.env.get("DATABASE_URL"),
            redis_url=self.env.get("REDIS_URL"),
            job_stale_after_s=int(self.env["JOB_STALE_AFTER_S"]),
        )

    def start_worker(
        self, name: str, extra_env: dict[str, str] | None = None, wait: bool = True
    ) -> Worker:
        log = self.home / f"{name.replace('@', '_')}-{len(self.workers)}.log"
        env = {**os.environ, **self.env, **(extra_env or {})}
        fh = open(log, "wb")  # noqa: SIM115 - the child owns it
        proc = subprocess.Popen(
            [sys.executable, "-m", "app.cli", "worker", "--name", name, "--loglevel", "INFO"],
            cwd=ROOT,
            env=env,
            stdout=fh,
            stderr=subprocess.STDOUT,
        )
        fh.close()
        w = Worker(name, proc, log)
        self.workers.append(w)
        if wait:
            w.wait_ready()
        return w

    def job(self, job_id: int) -> dict[str, Any]:
        from app import services

        job = services.get_job(self.settings, job_id)
        assert job is not None
        return job

    def wait_for(
        self, job_id: int, pred: Callable[[dict[str, Any]], bool], timeout: float, what: str
    ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            job = self.job(job_id)
            if pred(job):
                return job
            if time.monotonic() > deadline:
                logs = "\n".join(w.log.read_text(errors="replace")[-2500:] for w in self.workers)
                raise AssertionError(
                    f"job {job_id} never {what}: {job}\n--- worker logs ---\n{logs}"
                )
            time.sleep(0.25)

    def wait_final(self, job_id: int, timeout: float = 90.0) -> dict[str, Any]:
        return self.wait_for(job_id, lambda j: j["status"] in FINAL, timeout, "finished")


@contextlib.contextmanager
def _stack(
    kind: str, tmp_path: Path, zoo_home: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Stack]:
    home = tmp_path / "home"
    home.mkdir()
    (home / "zoo").symlink_to(Path(zoo_home) / "zoo", target_is_directory=True)
    queue = f"fl-test-{secrets.token_hex(4)}"
    env = {
        "FISHERLENS_HOME": str(home),
        "FISHERLENS_QUEUE": queue,
        "JOB_STALE_AFTER_S": "300",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "FISHERLENS_DEVICE": os.environ.get("FISHERLENS_DEVICE", "cpu"),
        "PYTHONPATH": os.pathsep.join(
            p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p
        ),
    }
    pg = None
    if kind == "redis":
        _redis_or_skip()
        env["REDIS_URL"] = REDIS_URL
        pg = _pg_schema()
        url = next(pg)
        if url:
            env["DATABASE_URL"] = url
    # This process (services.submit) must see the same queue name and settings.
    for k in ("REDIS_URL", "DATABASE_URL"):
        monkeypatch.delenv(k, raising=False)
    for k in ("FISHERLENS_HOME", "REDIS_URL", "DATABASE_URL", "FISHERLENS_DEVICE"):
        if k in env:
            monkeypatch.setenv(k, env[k])
    monkeypatch.setenv("FISHERLENS_QUEUE", queue)
    import compute.celery_app as ca

    monkeypatch.setattr(ca, "QUEUE", queue)
    ca._apps.clear()
    s = Stack(kind, home, env)
    try:
        yield s
    finally:
        for w in s.workers:
            w.kill()  # tests are done with them; a warm shutdown only costs time
        ca._apps.clear()
        if kind == "redis":
            import redis

            r = redis.Redis.from_url(REDIS_URL)
            for key in r.scan_iter(f"*{queue}*"):
                r.delete(key)
            # Messages of killed workers wait in kombu's "unacked" hash for the visibility
            # timeout; drop ours so they are not restored into a dead queue hours later.
            for tag, raw in r.hgetall("unacked").items():
                try:
                    routing_key = json.loads(raw)[2]
                except (ValueError, IndexError, TypeError):
                    continue
                if routing_key == queue:
                    r.hdel("unacked", tag)
                    r.zrem("unacked_index", tag)
        if pg is not None:
            next(pg, None)


@pytest.fixture(params=["filesystem", pytest.param("redis", marks=pytest.mark.redis)])
def stack(
    request: pytest.FixtureRequest, tmp_path: Path, zoo_home: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Stack]:
    """Both deployments: embedded (filesystem queue + SQLite) and Redis + PostgreSQL."""
    with _stack(request.param, tmp_path, zoo_home, monkeypatch) as s:
        yield s


@pytest.fixture
def fs_stack(tmp_path: Path, zoo_home: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Stack]:
    with _stack("filesystem", tmp_path, zoo_home, monkeypatch) as s:
        yield s


@pytest.fixture
def redis_stack(tmp_path: Path, zoo_home: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Stack]:
    with _stack("redis", tmp_path, zoo_home, monkeypatch) as s:
        yield s
