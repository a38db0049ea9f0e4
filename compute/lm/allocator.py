"""The C allocator's policy for a job process (issue 30): what a job holds should be what the
machine sees it hold.

glibc keeps freed memory in the process: by default it raises its mmap threshold to the size of
each large block freed (up to 32 MiB), after which tensors of a few MiB come from the heap and,
freed, stay resident; a job whose phases allocate differently (sampling, per-sample passes,
per-tensor reads) then peaks at what one phase left behind plus what the next one maps anew.
Every job runs with a fixed threshold (`fixed_mmap_threshold`, set by
compute.jobs.runners for every kind, in the CLI and the worker alike) and a job may hand freed
memory back between phases (`release_freed_memory`). Both are no-ops off glibc.
"""

from __future__ import annotations

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


M_MMAP_THRESHOLD = -3  # glibc mallopt parameter (malloc.h)


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
