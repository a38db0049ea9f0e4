"""The README's quick start runs as written: its shell blocks (the direct CLI loop, then the
queued loop against `fisherlens up`) and its Python block, in a fresh FISHERLENS_HOME and an empty
folder, as a newcomer would paste them."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def quickstart_blocks(readme: str) -> list[tuple[str, str]]:
    """(language, code) of every fenced block in the README's "Quick start" section."""
    m = re.search(r"^## Quick start.*?$(.*?)^## ", readme, re.M | re.S)
    assert m, "README.md has no '## Quick start' section"
    return [(lang, code) for lang, code in re.findall(r"```(\w+)\n(.*?)```", m.group(1), re.S)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_readme_quickstart_blocks_run(tmp_path: Path) -> None:
    blocks = quickstart_blocks((ROOT / "README.md").read_text())
    shell = [c for lang, c in blocks if lang == "bash"]
    python = [c for lang, c in blocks if lang == "python"]
    assert len(shell) == 2 and len(python) == 1, blocks
    work = tmp_path / "work"
    work.mkdir()
    port = _free_port()
    env = {**os.environ, "FISHERLENS_HOME": str(tmp_path / "home"), "PYTHONPATH": str(ROOT),
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1",
           "FISHERLENS_DEVICE": "cpu", "FISHERLENS_QUEUE": f"fl-quickstart-{port}"}
    for k in ("DATABASE_URL", "REDIS_URL", "PUBLIC_URL", "ARTIFACT_URL", "FISHERLENS_CREDENTIALS"):
        env.pop(k, None)
    env["FISHERLENS_CREDENTIALS"] = str(tmp_path / "no-credentials.json")

    def sh(code: str) -> str:
        p = subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=work, env=env,
                           capture_output=True, text=True, timeout=900)
        assert p.returncode == 0, f"block failed:\n{code}\n--- output ---\n{p.stdout[-3000:]}{p.stderr[-3000:]}"
        return p.stdout + p.stderr

    out = sh(shell[0])  # the direct loop
    for f in ("runs/fisher/fisher.safetensors", "runs/mask.safetensors", "runs/grpo-masked",
              "runs/diff/diff.json"):
        assert (work / f).exists(), f"{f} missing after the quick start:\n{out[-2000:]}"
    assert "similarity removes" in out or "Fisher trace" in out

    p = subprocess.run([sys.executable, "-c", python[0]], cwd=work, env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    top1, gini, jac = (float(x) for x in p.stdout.split()[-3:])
    assert 0 < top1 <= 1 and 0 <= gini <= 1 and 0 <= jac <= 1

    log = (tmp_path / "up.log").open("wb")
    up = subprocess.Popen([sys.executable, "-m", "app.cli", "up", "--port", str(port)], cwd=work,
                          env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while "ready." not in (tmp_path / "up.log").read_text(errors="replace"):
            assert up.poll() is None and time.monotonic() < deadline, \
                (tmp_path / "up.log").read_text(errors="replace")[-3000:]
            time.sleep(0.5)
        out = sh(shell[1])  # the queued loop, ending in `fisherlens status 3 --wait`
        assert "succeeded" in out, out[-3000:]
    finally:
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(timeout=60)
        except subprocess.TimeoutExpired:
            up.kill()
