"""Every job runs under one allocator policy, whatever its kind (compute.lm.allocator, issue 30):
glibc's mmap threshold fixed, so what a phase frees leaves the process instead of staying
resident and adding to the next phase's peak."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from compute.jobs import runners
from compute.jobs.registry import KINDS

ROOT = Path(__file__).resolve().parents[2]

# a 16 MiB block freed raises glibc's dynamic threshold; then 4 MiB blocks come from the heap,
# and with the last one still held, the ones freed before it stay resident
SCRIPT = r"""
import ctypes, json, sys
sys.path.insert(0, sys.argv[1])
from compute.jobs.runners import in_job_process
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS")) / 1024
def phases():
    big = libc.malloc(16 << 20); libc.memset(big, 1, 16 << 20); libc.free(big)
    before = rss()
    blocks = [libc.malloc(4 << 20) for _ in range(20)]
    for b in blocks:
        libc.memset(b, 1, 4 << 20)
    for b in blocks[:-1]:
        libc.free(b)
    kept = rss() - before
    libc.free(blocks[-1])
    return kept
run = in_job_process(phases) if sys.argv[2] == "job" else phases
print(json.dumps(run()))
"""


def _kept(mode: str) -> float:
    p = subprocess.run([sys.executable, "-c", SCRIPT, str(ROOT), mode], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_a_job_process_hands_freed_blocks_back():
    """Outside a job, 19 freed 4 MiB blocks stay resident (76 MiB); inside, they leave."""
    plain, job = _kept("plain"), _kept("job")
    assert plain > 60, f"the allocator kept {plain:.0f} MiB outside a job (the premise of the test)"
    assert job < 12, f"a job process kept {job:.0f} MiB of freed 4 MiB blocks"


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_kind_runs_through_the_policy(kind):
    """get_runner and the child protocol hand out the kind's own functions wrapped in it."""
    module = runners._module(kind)
    run = runners.get_runner(kind)
    assert run.__wrapped__ is getattr(module, runners.RUNNERS[kind].split(":")[1])
    protocol = runners.child_protocol(kind)
    if protocol is not None:
        assert protocol.run_child.__wrapped__ is module.run_child
        assert protocol.combine.__wrapped__ is module.combine
