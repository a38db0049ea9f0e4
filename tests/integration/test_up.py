"""`fisherlens up`: migrates, starts one worker process and the web app, and stops both on
SIGTERM / Ctrl-C (no orphaned worker)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped) counts as gone.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_up_starts_worker_and_app_and_stops_both(tmp_path: Path, zoo_home: Path, sig: int) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / "zoo").symlink_to(Path(zoo_home) / "zoo", target_is_directory=True)
    port = _free_port()
    env = {
        **os.environ,
        "FISHERLENS_HOME": str(home),
        "FISHERLENS_QUEUE": f"fl-up-{port}",
        "OMP_NUM_THREADS": "1",
        "FISHERLENS_DEVICE": "cpu",
        "PYTHONPATH": str(ROOT),
    }
    for k in ("DATABASE_URL", "REDIS_URL", "PUBLIC_URL"):
        env.pop(k, None)
    log = tmp_path / "up.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "app.cli", "up", "--port", str(port)],
            cwd=ROOT,
            env=env,
            stdout=fh,
            stderr=subprocess.STDOUT,
        )
    worker_pid = None
    try:
        deadline = time.monotonic() + 120
        web_ok = False
        while time.monotonic() < deadline and proc.poll() is None:
            text = log.read_text(errors="replace")
            m = re.search(r"worker started \(pid (\d+)\)", text)
            worker_pid = int(m.group(1)) if m else worker_pid
            if "web app is not available" in text and worker_pid and "ready." in text:
                break
            if "fisherlens is up" in text:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as r:
                        web_ok = r.status == 200
                except OSError:
                    pass
                if web_ok and "ready." in text:
                    break
            time.sleep(0.5)
        text = log.read_text(errors="replace")
        assert proc.poll() is None, text[-3000:]
        assert worker_pid and _alive(worker_pid), text[-3000:]
        assert (home / "fisherlens.db").exists()  # migrated SQLite under FISHERLENS_HOME
        if "fisherlens is up" in text:
            assert web_ok, text[-3000:]
            assert f"http://127.0.0.1:{port}" in text
        proc.send_signal(sig)
        proc.wait(timeout=60)
        deadline = time.monotonic() + 30
        while _alive(worker_pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(worker_pid), "worker left running after `up` stopped"
        assert "fisherlens stopped" in log.read_text(errors="replace")
    finally:
        for pid in (proc.pid, worker_pid):
            if pid and _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_up_restarts_its_worker_when_it_dies(tmp_path: Path, zoo_home: Path) -> None:
    """kill -9 the embedded worker: `up` starts a new one (same name, so it re-queues the dead
    one's job at start-up), and still stops it on SIGTERM."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "zoo").symlink_to(Path(zoo_home) / "zoo", target_is_directory=True)
    port = _free_port()
    env = {
        **os.environ,
        "FISHERLENS_HOME": str(home),
        "FISHERLENS_QUEUE": f"fl-up-{port}",
        "OMP_NUM_THREADS": "1",
        "FISHERLENS_DEVICE": "cpu",
        "PYTHONPATH": str(ROOT),
    }
    for k in ("DATABASE_URL", "REDIS_URL", "PUBLIC_URL"):
        env.pop(k, None)
    log = tmp_path / "up.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "app.cli", "up", "--port", str(port)],
            cwd=ROOT,
            env=env,
            stdout=fh,
            stderr=subprocess.STDOUT,
        )
    pids: list[int] = []

    def wait_log(pattern: str, count: int = 1) -> list[str]:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            text = log.read_text(errors="replace")
            found = re.findall(pattern, text)
            if len(found) >= count:
                return found
            assert proc.poll() is None, text[-3000:]
            time.sleep(0.2)
        raise AssertionError(f"{pattern!r} x{count} not in the log:\n{text[-3000:]}")

    try:
        first = int(wait_log(r"worker started \(pid (\d+)\)")[0])
        pids.append(first)
        wait_log(r"(embedded-\d+@\S+) ready\.")
        os.kill(first, signal.SIGKILL)
        second = int(wait_log(r"worker restarted \(restart 1\) \(pid (\d+)\)")[0])
        pids.append(second)
        names = wait_log(r"(embedded-\d+@\S+) ready\.", count=2)
        assert second != first and _alive(second) and not _alive(first)
        assert names[0] == names[1] == f"embedded-{proc.pid}@{socket.gethostname()}"
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        deadline = time.monotonic() + 30
        while _alive(second) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(second), "restarted worker left running after `up` stopped"
    finally:
        for pid in (proc.pid, *pids):
            if pid and _alive(pid):
                os.kill(pid, signal.SIGKILL)
