"""Peak memory of one call, measured rather than sampled (shared by the benchmarks)."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def rss_mib() -> float:
    """This process's resident memory now, MiB (VmRSS): what the sampling profilers poll."""
    return _status_kib("VmRSS") / 1024


def rss_peak_of(fn: Callable[[], Any]) -> float:
    """MiB by which this process's RSS high-water mark rises above its RSS before fn runs. The
    mark is reset first (Linux >= 4.0: /proc/self/clear_refs "5"), so earlier peaks (loading the
    model) do not count. Run it in a fresh process for an allocator state that is not warm."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    before = _status_kib("VmRSS")
    fn()
    return (_status_kib("VmHWM") - before) / 1024
