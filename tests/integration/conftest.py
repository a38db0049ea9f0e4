"""Integration set-up: real `fisherlens worker` processes (Celery, solo pool) against the embedded
filesystem queue + SQLite, or real Redis + PostgreSQL (a missing service is a skip with the reason
on a laptop, a failure under CI: tests.conftest.require_service; there is no SQLite stand-in for
PostgreSQL). Each test gets its own home, queue name and DB schema.

Fault injection is deterministic: a worker started with `faults=[...]` stops at those named points
(compute.runtime.control.fault_point: test-only, FISHERLENS_TESTING=1) and the test waits for the point's
marker file (`stack.wait_reached`), then kills, cancels, restarts Redis or releases it
(`stack.release`). No test depends on a job being slow enough to be interrupted."""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import require_service
from tests.pg import pg_schema_url

ROOT = Path(__file__).resolve().parents[2]
REDIS_URL = os.environ.get("FISHERLENS_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
PG_URL = os.environ.get(
    "FISHERLENS_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
FINAL = ("succeeded", "failed", "cancelled")


def _redis_or_skip(url: str = REDIS_URL) -> None:
    try:
        import redis

        redis.Redis.from_url(url, socket_connect_timeout=2).ping()
    except Exception as exc:  # noqa: BLE001
        require_service(
            f"Redis not reachable at {url} ({type(exc).__name__}); set FISHERLENS_TEST_REDIS_URL"
        )


def _pg_schema() -> Iterator[str]:
    """A fresh PostgreSQL schema URL (dropped afterwards); no PostgreSQL is a skip, or under CI
    a failure. Never a silent SQLite stand-in."""
    with pg_schema_url("fl_it") as url:
        yield url


@dataclass
class Worker:
    name: str | None  # None: the worker's default name, read from its log once ready
    proc: subprocess.Popen[bytes]
    log: Path

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.log.read_text(errors="replace") if self.log.exists() else ""
            m = re.search(r"(\S+@\S+) ready\.", text)
            if m and (self.name is None or m.group(1) == self.name):
                self.name = m.group(1)
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
        from compute.contract.settings import Settings

        return Settings(
            fisherlens_home=self.home,
            database_url=self.env.get("DATABASE_URL"),
            redis_url=self.env.get("REDIS_URL"),
            job_stale_after_s=int(self.env["JOB_STALE_AFTER_S"]),
            reconcile_interval_s=float(self.env["RECONCILE_INTERVAL_S"]),
            reconcile_queued_after_s=float(self.env["RECONCILE_QUEUED_AFTER_S"]),
        )

    @property
    def fault_dir(self) -> Path:
        return Path(self.env["FISHERLENS_FAULT_DIR"])

    def start_worker(
        self,
        name: str | None = None,
        extra_env: dict[str, str] | None = None,
        wait: bool = True,
        faults: tuple[str, ...] | list[str] = (),
    ) -> Worker:
        """A `fisherlens worker` process (default name worker-PID@HOST when name is None) that
        stops at the named fault points (compute.runtime.control)."""
        label = (name or "default").replace("@", "_")
        log = self.home / f"{label}-{len(self.workers)}.log"
        env = {**os.environ, **self.env, **(extra_env or {})}
        env["FISHERLENS_FAULT_POINTS"] = ",".join(faults)
        fh = open(log, "wb")  # noqa: SIM115 - the child owns it
        cmd = [sys.executable, "-m", "app.cli", "worker", "--loglevel", "INFO"]
        if name:
            cmd += ["--name", name]
        proc = subprocess.Popen(
            cmd,
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

    def wait_final(self, job_id: int, timeout: float = 180.0) -> dict[str, Any]:
        return self.wait_for(job_id, lambda j: j["status"] in FINAL, timeout, "finished")

    def logs(self) -> str:
        return "\n".join(
            f"--- {w.name} ---\n" + w.log.read_text(errors="replace")[-4000:] for w in self.workers
        )

    def wait_reached(self, point: str, timeout: float = 180.0) -> str:
        """Wait until a worker stops at fault point `point` (its marker file appears); returns
        the marker's text. The bound only guards against a hang: the point is reached whatever
        the machine's speed."""
        marker = self.fault_dir / f"{point}.reached"
        deadline = time.monotonic() + timeout
        while not marker.exists():
            if time.monotonic() > deadline:
                raise AssertionError(f"fault point {point} never reached\n{self.logs()}")
            if self.workers and all(w.proc.poll() is not None for w in self.workers):
                raise AssertionError(f"every worker exited before {point}\n{self.logs()}")
            time.sleep(0.05)
        return marker.read_text()

    def release(self, point: str) -> None:
        (self.fault_dir / f"{point}.release").touch()

    def wait_all_final(self, job_ids: list[int], timeout: float = 240.0) -> list[dict[str, Any]]:
        return [self.wait_final(j, timeout=timeout) for j in job_ids]


@contextlib.contextmanager
def _stack(
    kind: str,
    tmp_path: Path,
    zoo_home: Path,
    monkeypatch: pytest.MonkeyPatch,
    redis_url: str | None = None,
) -> Iterator[Stack]:
    redis_url = redis_url or REDIS_URL
    home = tmp_path / "home"
    home.mkdir()
    (home / "zoo").symlink_to(Path(zoo_home) / "zoo", target_is_directory=True)
    queue = f"fl-test-{secrets.token_hex(4)}"
    env = {
        "FISHERLENS_HOME": str(home),
        "FISHERLENS_QUEUE": queue,
        "JOB_STALE_AFTER_S": "300",
        # The reconciler runs every second in tests; a queued job is re-sent 3 s after its
        # message went missing (production defaults: 30 s and 60 s).
        "RECONCILE_INTERVAL_S": "1",
        "RECONCILE_QUEUED_AFTER_S": "3",
        "FISHERLENS_TESTING": "1",
        "FISHERLENS_FAULT_DIR": str(home / "faults"),
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
        _redis_or_skip(redis_url)
        env["REDIS_URL"] = redis_url
        pg = _pg_schema()
        env["DATABASE_URL"] = next(pg)
    # This process (services.submit) must see the same queue name and settings.
    for k in ("REDIS_URL", "DATABASE_URL"):
        monkeypatch.delenv(k, raising=False)
    for k in (
        "FISHERLENS_HOME",
        "REDIS_URL",
        "DATABASE_URL",
        "FISHERLENS_DEVICE",
        "JOB_STALE_AFTER_S",
        "RECONCILE_INTERVAL_S",
        "RECONCILE_QUEUED_AFTER_S",
    ):
        if k in env:
            monkeypatch.setenv(k, env[k])
    monkeypatch.setenv("FISHERLENS_QUEUE", queue)
    import compute.runtime.celery_app as ca

    ca._apps.clear()
    s = Stack(kind, home, env)
    try:
        yield s
    finally:
        for w in s.workers:
            w.kill()  # tests are done with them; a warm shutdown only costs time
        ca._apps.clear()
        if kind == "redis" and redis_url == REDIS_URL:  # a private server just goes away
            _clean_shared_redis(queue)
        if pg is not None:
            next(pg, None)


def _clean_shared_redis(queue: str) -> None:
    import redis

    r = redis.Redis.from_url(REDIS_URL)
    for key in r.scan_iter(f"*{queue}*"):
        r.delete(key)
    # Messages of killed workers wait in kombu's "unacked" hash for the visibility timeout;
    # drop ours so they are not restored into a dead queue hours later.
    for tag, raw in r.hgetall("unacked").items():
        try:
            routing_key = json.loads(raw)[2]
        except (ValueError, IndexError, TypeError):
            continue
        if routing_key == queue:
            r.hdel("unacked", tag)
            r.zrem("unacked_index", tag)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PrivateRedis:
    """A redis-server of this test alone (free port, no persistence), so it can be restarted
    empty without touching the shared one."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.port = _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            require_service("redis-server is not installed (needed for the Redis restart test)")
        log = open(self.folder / f"redis-{self.port}.log", "ab")  # noqa: SIM115 - child owns it
        self.proc = subprocess.Popen(
            [
                str(exe),
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.folder),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        import redis

        deadline = time.monotonic() + 60
        while True:
            try:
                redis.Redis.from_url(self.url, socket_connect_timeout=1).ping()
                return
            except Exception:  # noqa: BLE001
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise AssertionError(f"redis-server on {self.port} did not start") from None
                time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def restart_empty(self) -> None:
        """Kill it (nothing saved) and start it again on the same port: every queue is gone."""
        self.stop()
        self.start()


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    r = PrivateRedis(tmp_path)
    r.start()
    try:
        yield r
    finally:
        r.stop()


@pytest.fixture
def private_redis_stack(
    private_redis: PrivateRedis, tmp_path: Path, zoo_home: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Stack]:
    """Redis (a private server, see PrivateRedis) + PostgreSQL."""
    with _stack("redis", tmp_path, zoo_home, monkeypatch, redis_url=private_redis.url) as s:
        yield s


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


class PrivatePostgres:
    """A PostgreSQL server of this test alone (initdb in a temporary folder, a free port, no
    fsync), so it can be stopped and started under running workers without touching the shared
    server on 5432. initdb refuses to run as root: as root it runs as the `postgres` user."""

    def __init__(self) -> None:
        import tempfile

        self.folder = Path(tempfile.mkdtemp(prefix="fl-pg-"))
        self.data = self.folder / "data"
        self.port = _free_port()
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"
        bindir = Path(shutil.which("pg_ctl") or "/usr/lib/postgresql/15/bin/pg_ctl").resolve().parent
        self.pg_ctl, self.initdb = bindir / "pg_ctl", bindir / "initdb"
        if not self.pg_ctl.exists() or not self.initdb.exists():
            require_service("pg_ctl / initdb are not installed (needed for the PostgreSQL outage test)")
        self._as: list[str] = []
        if os.geteuid() == 0:
            self._as = ["runuser", "-u", "postgres", "--"]
            shutil.chown(self.folder, "postgres", "postgres")

    def _run(self, *cmd: str | Path) -> None:
        out = subprocess.run([*self._as, *map(str, cmd)], capture_output=True, text=True)
        if out.returncode != 0:
            raise AssertionError(f"{cmd[0]} failed: {out.stdout[-2000:]}{out.stderr[-2000:]}")

    def init(self) -> None:
        self._run(self.initdb, "-D", self.data, "-U", "postgres", "-A", "trust", "--no-sync")

    def start(self) -> None:
        opts = f"-p {self.port} -k {self.folder} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._run(self.pg_ctl, "-D", self.data, "-l", self.folder / "server.log", "-o", opts,
                  "-w", "-t", "120", "start")

    def stop(self) -> None:
        """Stop at once (like a crash or a pulled cable: clients see their connections die)."""
        self._run(self.pg_ctl, "-D", self.data, "-m", "immediate", "-w", "stop")

    def remove(self) -> None:
        with contextlib.suppress(AssertionError):
            self.stop()
        shutil.rmtree(self.folder, ignore_errors=True)


@pytest.fixture
def private_pg() -> Iterator[PrivatePostgres]:
    pg = PrivatePostgres()
    pg.init()
    pg.start()
    try:
        yield pg
    finally:
        pg.remove()


@pytest.fixture
def private_pg_stack(
    private_pg: PrivatePostgres,
    private_redis: PrivateRedis,
    tmp_path: Path,
    zoo_home: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Stack]:
    """Redis + PostgreSQL, both private servers (PrivateRedis, PrivatePostgres), so a test can
    stop and start either under running workers."""
    with _stack("filesystem", tmp_path, zoo_home, monkeypatch) as s:
        s.kind = "private"
        s.env["REDIS_URL"], s.env["DATABASE_URL"] = private_redis.url, private_pg.url
        monkeypatch.setenv("REDIS_URL", private_redis.url)
        monkeypatch.setenv("DATABASE_URL", private_pg.url)
        try:
            yield s
        finally:
            from storage.db import _engines, _factories

            for w in s.workers:
                w.kill()
            for url in [u for u in _engines if f":{private_pg.port}/" in u]:
                _engines.pop(url).dispose()
                _factories.pop(url, None)
            from app.auth import token_cache

            token_cache.disable_urls(lambda u: f":{private_pg.port}/" in u)
