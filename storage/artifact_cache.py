"""A local cache of artifacts read from object storage, keyed by sha256, with a size cap and
least-recently-used eviction, shared safely by every process on one machine (a worker per GPU,
the web).

Layout under the cache root:

    entries/<sha256>/.lock     the entry's lock file; its text is the entry's size in bytes, its
                               mtime the entry's last use (LRU order)
    entries/<sha256>/<name>    the file or folder (the artifact's own base name, so that
                               downloads and from_pretrained see the names they expect)
    tmp/<random>/              a download (or an eviction) in progress (new-<random>/ until its
                               writer lock is held)
    scratch/                   per-job scratch folders of workers (same file system: a trained
                               model folder moves into the cache by a rename)

Only verified content ever enters `entries/`: a download is staged in `tmp/`, checked against its
sha256 there, and installed by one atomic rename of its folder. Locks are flock(2) locks on the
`.lock` files: a process using an entry holds a shared lock ("pin"); eviction takes an exclusive
lock without waiting, so an entry in use is never removed; it then renames the entry into `tmp/`
(readers that arrive later miss and download again) and deletes it. A staging folder is held
exclusively by its writer, so a crashed writer's leftovers are recognised (the lock is free) and
removed by the next eviction pass, with no timeouts.

Pins are counted per entry and process: `unpin(path)` drops one (the web, once a download has
been sent), `release_pins()` drops all (a worker, when a job ends); past MAX_PINS entries the
least recently pinned ones are dropped.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
import shutil
import threading
import time
from collections import OrderedDict
from pathlib import Path

log = logging.getLogger("fisherlens.artifacts")

MAX_PINS = 64
LOCK = ".lock"
WRITER = ".writer"
NEW = "new-"  # a staging folder before its writer lock is held (stage)
STALE_NEW_SECONDS = 3600  # such a folder older than this was left by a crash

_pins: OrderedDict[str, list[int]] = OrderedDict()  # entry folder -> [fd (shared lock), count]
_pins_guard = threading.Lock()
_staging: dict[str, tuple[int, int]] = {}  # staging folder -> (writer fd, entry-lock fd)


def _pin(entry: Path, fd: int) -> None:
    with _pins_guard:
        key = str(entry)
        held = _pins.get(key)
        if held is not None:  # one lock per entry and process is enough
            os.close(fd)
            held[1] += 1
            _pins.move_to_end(key)
        else:
            _pins[key] = [fd, 1]
        while len(_pins) > MAX_PINS:
            _, (stale, _n) = _pins.popitem(last=False)
            os.close(stale)


def unpin(path: Path | str) -> None:
    """Drop one pin of the entry holding cached `path` (from ArtifactCache.get/install)."""
    key = str(Path(path).parent)
    with _pins_guard:
        held = _pins.get(key)
        if held is None:
            return
        held[1] -= 1
        if held[1] <= 0:
            del _pins[key]
            os.close(held[0])


def release_pins() -> None:
    """Let every entry this process pinned be evicted again (a worker calls it after each job)."""
    with _pins_guard:
        while _pins:
            _, (fd, _n) = _pins.popitem()
            os.close(fd)


def pinned() -> list[str]:
    with _pins_guard:
        return list(_pins)


def _touch(lock: Path) -> None:
    """Mark an entry used now. An explicit nanosecond time: the kernel's own file times are
    coarse (a clock tick), too coarse to order uses a few milliseconds apart."""
    now = time.time_ns()
    with contextlib.suppress(OSError):
        os.utime(lock, ns=(now, now))


def _entry_size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


class ArtifactCache:
    def __init__(self, root: Path | str, max_bytes: int):
        self.root = Path(root).expanduser().resolve()
        self.max_bytes = int(max_bytes)
        self.entries = self.root / "entries"
        self.tmp = self.root / "tmp"
        self.scratch = self.root / "scratch"
        for d in (self.entries, self.tmp, self.scratch):
            d.mkdir(parents=True, exist_ok=True)

    # -- reading ----------------------------------------------------------------------------
    def _lock_entry(self, entry: Path) -> int | None:
        """A shared lock on an installed entry, or None when there is none (or it was just
        evicted)."""
        lock = entry / LOCK
        try:
            fd = os.open(lock, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            # An evictor may have moved the entry away while we waited for the lock.
            if os.stat(lock).st_ino != os.fstat(fd).st_ino:
                os.close(fd)
                return None
        except FileNotFoundError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        return fd

    def get(self, sha256: str, name: str) -> Path | None:
        """The cached `<name>` of content `sha256`, pinned in this process and marked used;
        None on a miss."""
        entry = self.entries / sha256
        fd = self._lock_entry(entry)
        if fd is None:
            return None
        target = entry / name
        if not target.exists():
            os.close(fd)
            return None
        _touch(entry / LOCK)
        _pin(entry, fd)
        return target

    # -- writing ----------------------------------------------------------------------------
    def stage(self) -> Path:
        """A new staging folder in tmp/ (held by this process until install() or discard())."""
        # Made under a "new-" name and renamed once its writer lock is held: a folder _clean_tmp can
        # see is always locked while its writer lives (between creating the lock file and locking
        # it, another process's _clean_tmp would otherwise take it for a dead writer's and remove it).
        token = secrets.token_hex(8)
        fresh, path = self.tmp / f"{NEW}{token}", self.tmp / token
        fresh.mkdir()
        writer = os.open(fresh / WRITER, os.O_CREAT | os.O_RDWR, 0o644)
        fcntl.flock(writer, fcntl.LOCK_EX)  # alive: _clean_tmp leaves it alone
        lock = os.open(fresh / LOCK, os.O_CREAT | os.O_RDWR, 0o644)
        fcntl.flock(lock, fcntl.LOCK_SH)  # the entry's pin, held across the install rename
        os.rename(fresh, path)
        _staging[str(path)] = (writer, lock)
        return path

    def discard(self, staged: Path) -> None:
        fds = _staging.pop(str(staged), None)
        shutil.rmtree(staged, ignore_errors=True)
        for fd in fds or ():
            os.close(fd)

    def install(self, sha256: str, name: str, staged: Path) -> Path:
        """Move the verified `staged/<name>` into the cache as content `sha256` (one atomic
        rename of the staging folder); returns the cached path, pinned. Evicts past the cap."""
        writer, lock = _staging.pop(str(staged))
        size = _entry_size(staged / name)
        with open(staged / LOCK, "w") as fh:  # the size, read by eviction
            fh.write(str(size))
        _touch(staged / LOCK)
        entry = self.entries / sha256
        try:
            os.rename(staged, entry)
        except OSError:  # installed meanwhile by another process (or under another name)
            os.close(lock)
            cached = self.get(sha256, name)
            if cached is None:  # present under another name only: add ours beside it
                other = self._lock_entry(entry)
                if other is not None:
                    with contextlib.suppress(OSError):
                        os.rename(staged / name, entry / name)
                        total = sum(_entry_size(p) for p in entry.iterdir()
                                    if p.name not in (LOCK, WRITER))
                        (entry / LOCK).write_text(str(total))
                    _pin(entry, other)
                    cached = entry / name if (entry / name).exists() else None
            shutil.rmtree(staged, ignore_errors=True)
            os.close(writer)
            if cached is None:
                raise
            return cached
        with contextlib.suppress(OSError):
            os.unlink(entry / WRITER)
        os.close(writer)
        _pin(entry, lock)
        self.evict(keep={sha256})
        return entry / name

    # -- eviction ---------------------------------------------------------------------------
    def size(self) -> int:
        return sum(size for _, size, _ in self._entries())

    def _entries(self) -> list[tuple[Path, int, int]]:
        out = []
        for entry in self.entries.iterdir():
            lock = entry / LOCK
            try:
                st = lock.stat()
                size = int(lock.read_text() or 0)
            except (OSError, ValueError):
                continue
            out.append((entry, size, st.st_mtime_ns))
        return out

    def evict(self, keep: set[str] = frozenset()) -> list[str]:  # type: ignore[assignment]
        """Remove least-recently-used entries until the cache holds at most max_bytes (entries
        in use by any process, and `keep`, stay). Returns the sha256s removed. One evictor at
        a time per cache (an exclusive lock on the root's .evict file)."""
        removed: list[str] = []
        gfd = os.open(self.root / ".evict", os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(gfd, fcntl.LOCK_EX)
            self._clean_tmp()
            entries = sorted(self._entries(), key=lambda e: e[2])
            total = sum(size for _, size, _ in entries)
            for entry, size, _ in entries:
                if total <= self.max_bytes:
                    break
                if entry.name in keep or not self._remove(entry):
                    continue
                total -= size
                removed.append(entry.name)
            if total > self.max_bytes:
                log.info("artifact cache %s holds %d bytes (cap %d): the rest is in use",
                         self.root, total, self.max_bytes)
        finally:
            os.close(gfd)
        return removed

    def _remove(self, entry: Path) -> bool:
        try:
            fd = os.open(entry / LOCK, os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # pinned by a process using it
            os.close(fd)
            return False
        trash = self.tmp / f"evict-{secrets.token_hex(8)}"
        try:
            os.rename(entry, trash)
        finally:
            os.close(fd)
        shutil.rmtree(trash, ignore_errors=True)
        return True

    def _clean_tmp(self) -> None:
        """Remove staging folders whose writer is gone (their writer lock is free) and evicted
        entries a crashed evictor left behind."""
        for path in self.tmp.iterdir():
            if str(path) in _staging:
                continue
            if path.name.startswith("evict-"):
                shutil.rmtree(path, ignore_errors=True)
                continue
            if path.name.startswith(NEW):  # being staged; left behind only by a crash right there
                with contextlib.suppress(OSError):
                    if time.time() - path.stat().st_mtime > STALE_NEW_SECONDS:
                        shutil.rmtree(path, ignore_errors=True)
                continue
            try:
                fd = os.open(path / WRITER, os.O_RDONLY)
            except (FileNotFoundError, NotADirectoryError):
                continue  # just created (its writer lock comes next), or not ours
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            shutil.rmtree(path, ignore_errors=True)
            os.close(fd)
