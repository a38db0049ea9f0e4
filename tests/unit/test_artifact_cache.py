"""The machine-local artifact cache (storage/artifact_cache.py): least-recently-used eviction
under the size cap, entries in use never evicted, crashed writers' leftovers removed, and two
processes sharing one cache under a small cap always reading verified bytes."""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from storage.artifact_cache import ArtifactCache, pinned, release_pins

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _unpin() -> Iterator[None]:
    yield
    release_pins()


def _add(cache: ArtifactCache, data: bytes, name: str = "a.bin") -> tuple[str, Path]:
    sha = hashlib.sha256(data).hexdigest()
    staged = cache.stage()
    (staged / name).write_bytes(data)
    return sha, cache.install(sha, name, staged)


def test_least_recently_used_entries_go_first(tmp_path: Path) -> None:
    cache = ArtifactCache(tmp_path, max_bytes=1000)
    a, _ = _add(cache, b"a" * 400)
    b, _ = _add(cache, b"b" * 400)
    release_pins()
    assert cache.get(a, "a.bin") is not None  # a is now more recently used than b
    release_pins()
    c, path_c = _add(cache, b"c" * 400)  # 1200 > 1000: one entry must go
    assert path_c.read_bytes() == b"c" * 400
    assert cache.get(b, "a.bin") is None and cache.get(a, "a.bin") is not None
    assert cache.get(c, "a.bin") is not None and cache.size() == 800


def test_entries_in_use_are_never_evicted(tmp_path: Path) -> None:
    cache = ArtifactCache(tmp_path, max_bytes=500)
    a, path_a = _add(cache, b"a" * 400)  # pinned by this process until release_pins()
    b, path_b = _add(cache, b"b" * 400)
    assert path_a.exists() and path_b.exists() and cache.size() == 800  # over the cap: in use
    # another process cannot evict them either (flock: shared pins block its exclusive lock)
    code = (f"from storage.artifact_cache import ArtifactCache; "
            f"print(ArtifactCache({str(tmp_path)!r}, 0).evict())")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True)
    assert out.stdout.strip() == "[]" and path_a.exists() and path_b.exists()
    release_pins()
    assert pinned() == []
    assert cache.evict() == [a]  # the least recently used one, down to the cap
    assert cache.size() == 400 and path_b.exists() and not path_a.exists()


def test_a_crashed_writers_staging_folder_is_removed(tmp_path: Path) -> None:
    code = (f"from storage.artifact_cache import ArtifactCache; c = ArtifactCache({str(tmp_path)!r}, 10); "
            "s = c.stage(); (s / 'half.bin').write_bytes(b'x' * 5); import os; os._exit(0)")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})
    cache = ArtifactCache(tmp_path, 10)
    assert len(list(cache.tmp.iterdir())) == 1
    live = cache.stage()  # ours, alive: kept
    cache.evict()
    assert list(cache.tmp.iterdir()) == [live]
    cache.discard(live)


def _reader(root: str, blobs: list[bytes], rounds: int, out: multiprocessing.Queue) -> None:
    """One process reading through the shared cache: every fetch must give verified bytes."""
    cache = ArtifactCache(root, max_bytes=2500)
    bad = 0
    for i in range(rounds):
        data = blobs[(i * 7 + os.getpid()) % len(blobs)]
        sha = hashlib.sha256(data).hexdigest()
        path = cache.get(sha, "blob.bin")
        if path is None:
            staged = cache.stage()
            (staged / "blob.bin").write_bytes(data)
            path = cache.install(sha, "blob.bin", staged)
        if hashlib.sha256(path.read_bytes()).hexdigest() != sha:
            bad += 1
        release_pins()
    out.put(bad)


def test_two_processes_share_one_cache_under_a_small_cap(tmp_path: Path) -> None:
    blobs = [bytes([i]) * 1000 for i in range(6)]  # 6000 bytes of entries, cap 2500
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_reader, args=(str(tmp_path), blobs, 60, out)) for _ in range(2)]
    for p in procs:
        p.start()
    results = [out.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert results == [0, 0] and all(p.exitcode == 0 for p in procs)
    cache = ArtifactCache(tmp_path, max_bytes=2500)
    cache.evict()
    assert cache.size() <= 2500
    assert list(cache.tmp.iterdir()) == []  # nothing half-written left behind
    for entry in cache.entries.iterdir():  # every entry that is there is whole
        data = (entry / "blob.bin").read_bytes()
        assert hashlib.sha256(data).hexdigest() == entry.name


def test_pins_are_counted_per_reader(tmp_path: Path) -> None:
    """Two readers of one entry in a process (two downloads): it stays until both are done."""
    from storage.artifact_cache import unpin

    cache = ArtifactCache(tmp_path, max_bytes=0)
    sha, path = _add(cache, b"x" * 100)  # reader 1 (install pins)
    assert cache.get(sha, "a.bin") == path  # reader 2
    unpin(path)
    assert cache.evict() == [] and path.exists()  # reader 2 still reads it
    unpin(path)
    assert pinned() == [] and cache.evict() == [sha] and not path.exists()
