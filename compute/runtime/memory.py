"""The C allocator, where a job's phases meet: memory a phase freed is handed back to the system
before the next phase starts, so a job's peak is its largest phase and not the sum of what glibc
kept from earlier ones (issue 30). glibc on Linux only; a no-op elsewhere (macOS, musl)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


def _glibc() -> Any:
    """The process's C library when it is glibc on Linux (it has malloc_trim), else None."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)  # the C library already loaded (no ldconfig subprocess)
        libc.malloc_trim  # noqa: B018 (glibc only: musl has none)
        libc.mallopt  # noqa: B018
    except (OSError, AttributeError):
        return None
    return libc


def release_freed_memory() -> None:
    """Give the C allocator's free memory back to the system (glibc's malloc_trim; a no-op
    elsewhere): after per-tensor reads (the base check, the diff) glibc keeps freed chunks in
    the process, which counts as resident memory until the next phase reuses it (issue 30)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


M_MMAP_THRESHOLD = -3  # glibc mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
# glibc's own thresholds once its dynamic adjustment has seen a large block freed (the state any
# model-running job reaches within its first tensors): mmap at DEFAULT_MMAP_THRESHOLD_MAX (32 MiB
# on 64-bit), trim at twice that. mallopt cannot turn the adjustment back on; this is its end state.
DYNAMIC_MMAP_THRESHOLD_MAX = 32 << 20


def fixed_mmap_threshold(nbytes: int = 1 << 20) -> None:
    """Fix glibc's mmap threshold at `nbytes` (a no-op elsewhere). By default glibc raises the
    threshold to the size of each large block freed (up to 32 MiB), after which tensors of a
    few MiB come from the heap and, freed, stay in the process; with a fixed threshold every
    block of `nbytes` or more is its own mapping, returned to the system when freed. Process-wide
    (a worker's later jobs keep it). Measured with release_freed_memory on bench_scale_train
    (docs/scale.md): 50m 140-141 MiB above the weights with both, 192-211 without either."""
    libc = _glibc()
    if libc is not None:
        libc.mallopt(M_MMAP_THRESHOLD, nbytes)


@contextlib.contextmanager
def mmap_threshold_fixed(nbytes: int = 1 << 20) -> Iterator[None]:
    """fixed_mmap_threshold(nbytes) inside, and glibc's dynamic end state (32 MiB mmap, 64 MiB
    trim threshold) restored on the way out, freed memory handed back: the train job's setting
    is the train job's. Measured: a Fisher job under the 1 MiB threshold ran its statistics 2-3x
    slower (every 4 MiB slice a fresh mapping) and peaked higher at 360M (docs/scale.md)."""
    fixed_mmap_threshold(nbytes)
    try:
        yield
    finally:
        libc = _glibc()
        if libc is not None:
            libc.mallopt(M_MMAP_THRESHOLD, DYNAMIC_MMAP_THRESHOLD_MAX)
            libc.mallopt(M_TRIM_THRESHOLD, 2 * DYNAMIC_MMAP_THRESHOLD_MAX)
        release_freed_memory()
