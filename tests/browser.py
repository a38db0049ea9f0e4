"""What the browser tests (tests/e2e/) share: where Chromium is, how it is started, where
screenshots go, and a free local port for the server under test."""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "test-artifacts" / "e2e"
CHROMIUM = os.environ.get("FISHERLENS_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
JOB_TIMEOUT_MS = 300_000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_job(page: Any, timeout_ms: int = JOB_TIMEOUT_MS) -> str | None:
    """Follow the result view's progress bar until its job ends (or the timeout): its last status."""
    import time

    deadline = time.monotonic() + timeout_ms / 1000
    status = None
    while time.monotonic() < deadline:
        status = page.get_attribute("#fl-progress .fl-progress", "data-status")
        if status in ("succeeded", "failed", "cancelled"):
            break
        page.wait_for_timeout(500)
    return status
