"""`./dev` tells the truth when torch cannot be fetched: the cause (an index that cannot be
reached) and what to do, not only pip's closing "conflicting dependencies" line.

Runs the real script on a fresh venv with no pip configuration and the CPU index pointed at a
closed local port, so nothing leaves the machine."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now: connections are refused at once
    return port


@pytest.mark.slow
def test_unreachable_torch_index_is_named_with_what_to_do(tmp_path: Path) -> None:
    index = f"http://127.0.0.1:{_closed_port()}/whl/cpu"
    env = {
        "PATH": os.environ["PATH"], "HOME": str(tmp_path),
        "FISHERLENS_VENV": str(tmp_path / "venv"), "PYTHON": sys.executable,
        "FISHERLENS_TORCH": "cpu", "FISHERLENS_TORCH_CPU_INDEX": index,
        # no pip configuration (so no local wheel folder), no retries, and PyPI unreachable too
        "PIP_CONFIG_FILE": os.devnull, "PIP_RETRIES": "0", "PIP_TIMEOUT": "3",
        "PIP_INDEX_URL": index, "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    }
    proc = subprocess.run(["bash", str(ROOT / "dev"), "fisherlens", "--help"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "[1/3] torch" in out
    assert f"127.0.0.1:{index.split(':')[2].split('/')[0]}" in out, out  # pip's own line naming the index
    assert "could not be reached" in out, out
    assert "PIP_FIND_LINKS" in out and "FISHERLENS_TORCH=keep" in out, out
    assert not (tmp_path / "venv" / ".fisherlens-installed").exists()
