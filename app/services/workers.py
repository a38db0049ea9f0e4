"""What the queue's workers offer a job: each live worker's device row (storage/workers.py, written
by the worker itself: compute/worker/device.py) and what a queued job is checked against and
priced by, through the same functions submit uses (app.limits.free_memory: the smallest free
memory, a queued job may run on any worker; app.ceiling.calibration: the slowest calibration).

Served by `GET /api/workers`, `fisherlens workers` and the Jobs tab's workers table. No torch.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any


def _iso(t: datetime | None) -> str | None:
    if t is None:
        return None
    return (t if t.tzinfo else t.replace(tzinfo=UTC)).isoformat()


def rate_text(cal: dict[str, Any] | None) -> str:
    """A calibration of the listing ("calibration" of a worker, "priced_by") as a person reads it:
    "1.01e-05 s + 2.24e-11 s x params per token-pass"."""
    if cal is None:
        return "not measured yet"
    return f"{cal['seconds_per_token_pass']:.3g} s + {cal['seconds_per_param_token_pass']:.3g} s x params per token-pass"


def workers(settings: Any) -> dict[str, Any]:
    """{"workers": [one dict per live worker, by name], "checked_against": {"auto", "cpu"}: the
    free memory a queued job on that device spec is checked against and where the figure comes
    from, "priced_by": the calibration an estimate uses, "live_after_s", "note"}.

    A worker's "calibration" is None when it has not measured its device (it was started with
    CALIBRATE_ON_UP off, or its measurement is still running)."""
    from app.ceiling import calibration, calibration_text, worker_devices
    from app.limits import free_memory
    from storage.workers import LIVE_AFTER_S

    now = datetime.now(UTC)
    rows = []
    for w in worker_devices(settings):
        seen = w["seen_at"] if w["seen_at"].tzinfo else w["seen_at"].replace(tzinfo=UTC)
        a, b = w["seconds_per_token_pass"], w["seconds_per_param_token_pass"]
        rows.append({
            "name": w["name"], "host": w["host"], "device": w["device"], "device_name": w["device_name"],
            "free_bytes": w["free_bytes"], "total_bytes": w["total_bytes"],
            "host_free_bytes": w["host_free_bytes"],
            "calibration": None if a is None or b is None else
            {"seconds_per_token_pass": a, "seconds_per_param_token_pass": b},
            "torch_version": w["torch_version"], "seen_at": _iso(seen),
            "seen_seconds_ago": round(max(0.0, (now - seen).total_seconds()), 1),
        })
    checked = {}
    for spec in ("auto", "cpu"):
        free, where = free_memory(settings, spec)
        checked[spec] = {"free_bytes": free, "where": where}
    cal = calibration(settings)
    priced = None if cal is None else {"seconds_per_token_pass": cal[0], "seconds_per_param_token_pass": cal[1],
                                       "where": calibration_text(cal)}
    kinds = sorted({str(w["device"]).split(":")[0] for w in rows})
    if len(kinds) > 1:  # a CPU worker beside GPU ones sizes every queued job for the CPU
        small = min((w for w in rows if w["free_bytes"] is not None), key=lambda w: w["free_bytes"], default=None)
        note = (f"{len(rows)} live workers on different kinds of device ({', '.join(kinds)}): a queued job may "
                "run on any, so it is checked against the smallest free memory"
                + (f" (worker {small['name']}, {small['device']})" if small else "")
                + " and priced at the slowest calibration; stop the workers a job should not land on")
    elif len(rows) == 1:
        note = ("1 live worker: queued jobs run there, so a job is checked against its free memory and priced "
                "at its calibration")
    elif rows:
        note = (f"{len(rows)} live worker{'s' if len(rows) != 1 else ''}: a queued job may run on any, so it is "
                "checked against the smallest free memory and priced at the slowest calibration")
    elif settings.max_job_memory_mb:
        note = "no live worker: queued jobs wait until one starts; jobs are checked against MAX_JOB_MEMORY_MB"
    else:
        note = ("no live worker: queued jobs wait until one starts (`fisherlens worker`, or `fisherlens up` "
                "with its embedded worker); until then a job is checked against this machine's own memory")
    return {"workers": rows, "checked_against": checked, "priced_by": priced,
            "live_after_s": LIVE_AFTER_S, "note": note}
