"""What this worker's device offers a job, written to the workers table (storage/workers.py) so
the web's estimate checks a job against the memory of the device it will run on and prices it
at that device's speed (app/limits.free_memory, app/ceiling.calibration). The web process of a
deployment has no GPU and never imports torch: before this, it compared every job with its own
RAM, so a job too large for an 80 GB GPU passed the check on a host with 256 GB and died there.

Written at start-up (tasks._on_worker_ready) and after every job, when the worker is idle (a
running job's own memory is not what the next job finds); the reconcile beat keeps the row
seen; shutdown removes it. The cost model is the worker home's `throughput.json` when it was
measured on the same kind of device (`fisherlens calibrate`, which docker-compose's workers run
before they start, and `fisherlens up` in the background); none otherwise.
"""

from __future__ import annotations

import logging
import os
import platform
from typing import Any

log = logging.getLogger("fisherlens.worker")


def _calibration(settings: Any, device_type: str) -> tuple[float | None, float | None]:
    """(a, b) of the home's throughput.json when it was measured on a `device_type` device."""
    from compute.contract.cost import read_calibration

    got = read_calibration(settings.home / "throughput.json")
    if got is None or got[2].split(":")[0] != device_type:
        return None, None
    return got[0], got[1]


def ensure_calibration(settings: Any) -> None:
    """Measure this worker's device (`fisherlens calibrate`'s code, seconds on a GPU, about 10 s
    on two CPU cores) into the home's throughput.json when the home has none measured on the same
    kind of device, and CALIBRATE_ON_UP allows it: the worker is the process that runs the jobs,
    so its device is the one to price them by."""
    from compute.lm.calibrate import calibrate, write
    from compute.lm.device import resolve_device

    if not settings.calibrate_on_up:
        return
    dev = resolve_device("auto")
    if _calibration(settings, dev.type) != (None, None):
        return
    try:
        write(settings.home / "throughput.json", calibrate(str(dev)))
        log.info("calibrated the cost model on %s", dev)
    except Exception:  # noqa: BLE001 - the worker runs jobs without it
        log.warning("could not calibrate the cost model on %s", dev, exc_info=True)


def profile(settings: Any) -> dict[str, Any]:
    """This worker's device and what a job may take there now (storage.workers.FIELDS)."""
    import torch

    from compute.lm.device import device_free_bytes, free_memory_bytes, resolve_device

    dev = resolve_device("auto")
    if dev.type == "cuda":
        dev = torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device())
        props = torch.cuda.get_device_properties(dev)
        total: int | None = int(props.total_memory)
        name = str(props.name)
        host_free: int | None = device_free_bytes(torch.device("cpu"))
    else:
        try:
            total = int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (ValueError, OSError, AttributeError):
            total = None
        name = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
        host_free = None
    a, b = _calibration(settings, dev.type)
    return {
        "host": platform.node(), "device": str(dev), "device_name": name,
        "free_bytes": int(free_memory_bytes(dev)), "total_bytes": total, "host_free_bytes": host_free,
        "seconds_per_token_pass": a, "seconds_per_param_token_pass": b,
        "torch_version": str(torch.__version__),
    }


def _write(settings: Any, what: str, fn: Any) -> Any:
    """fn(storage.workers, session) in a session of the jobs database; None, logged, when it
    fails (the device row is advice for the web, never a reason for a worker to stop)."""
    from storage import workers
    from storage.db import session_factory

    try:
        with session_factory(settings.db_url)() as s:
            return fn(workers, s)
    except Exception:  # noqa: BLE001
        log.warning("could not %s this worker's device row", what, exc_info=True)
        return None


def publish(settings: Any, name: str) -> None:
    """Write this worker's row now (never raises: a worker that cannot write it still runs jobs;
    the web then falls back to its own figures)."""
    try:
        fields = profile(settings)
    except Exception:  # noqa: BLE001
        log.warning("could not describe this worker's device", exc_info=True)
        return
    _write(settings, "write", lambda w, s: w.publish(session=s, name=name, **fields))


# the reconcile beat may run every second (tests); the row is kept seen at most this often, well
# inside storage.workers.LIVE_AFTER_S (one small write per worker per 20 s)
TOUCH_EVERY_S = 20.0
_touched = [0.0]


def touch(settings: Any, name: str) -> None:
    """Keep the row seen (the reconcile beat); writes it whole when it is missing."""
    import time

    now = time.monotonic()
    if now - _touched[0] < TOUCH_EVERY_S:
        return
    _touched[0] = now
    if _write(settings, "refresh", lambda w, s: w.touch(session=s, name=name)) is False:
        publish(settings, name)


def remove(settings: Any, name: str) -> None:
    _write(settings, "remove", lambda w, s: w.remove(session=s, name=name))
