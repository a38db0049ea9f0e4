"""The train job's allocator setting is the train job's (compute.runtime.memory.mmap_threshold_fixed):
inside it glibc hands freed blocks of 1 MiB and more back to the system; after it, glibc behaves
as its dynamic adjustment does once it has seen a large block freed, so a later job in the same
worker process (a Fisher's statistics, whose 4 MiB slices it would make fresh mappings) does not
inherit the 1 MiB threshold."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# a 16 MiB block freed raises glibc's dynamic threshold; then 4 MiB blocks come from the heap,
# and with the last one still held, the ones freed before it stay resident
SCRIPT = r"""
import ctypes, json, sys
sys.path.insert(0, sys.argv[1])
from compute.runtime.memory import mmap_threshold_fixed
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS")) / 1024
def kept():
    big = libc.malloc(16 << 20); libc.memset(big, 1, 16 << 20); libc.free(big)
    before = rss()
    blocks = [libc.malloc(4 << 20) for _ in range(20)]
    for b in blocks:
        libc.memset(b, 1, 4 << 20)
    for b in blocks[:-1]:
        libc.free(b)
    out = rss() - before
    libc.free(blocks[-1])
    return out
plain = kept()
with mmap_threshold_fixed():
    inside = kept()
after = kept()
print(json.dumps({"plain": plain, "inside": inside, "after": after}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_the_train_jobs_threshold_ends_with_the_job():
    p = subprocess.run([sys.executable, "-c", SCRIPT, str(ROOT)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["plain"] > 60, got  # the premise: glibc keeps 19 freed 4 MiB heap blocks (76 MiB)
    assert got["inside"] < 12, got  # each was its own mapping, returned when freed
    assert got["after"] > 60, got  # as before the job: 4 MiB blocks from the heap again
