"""The per-job ceiling of a user, in the cost unit of app/limits.py: a run time (MAX_JOB_SECONDS,
a user's max_job_seconds) turned into parameter-token-passes with the throughput a benchmark
measured on the workers' machine, or an explicit cost (MAX_JOB_COST, a user's max_job_cost).
Apart from app/limits.py so that app/auth (Principal's limits) can use it without a cycle."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO_THROUGHPUT = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "throughput.json"
# calibration()'s source for the committed file: the reference machine's, not this one's
REFERENCE = "reference"


def throughput(settings: Any) -> tuple[float, str] | None:
    """(parameter-token-passes per second, where it comes from): THROUGHPUT, else the JSON of
    THROUGHPUT_FILE, FISHERLENS_HOME/throughput.json or the committed benchmark result; None
    when none is readable (then only an explicit cost ceiling applies)."""
    if settings.throughput:
        return float(settings.throughput), "THROUGHPUT"
    for path in (settings.throughput_file, settings.home / "throughput.json", REPO_THROUGHPUT):
        if path is None:
            continue
        value = _throughput_file(Path(path))
        if value is not None:
            return value, str(Path(path).name)
    return None


# Set while a direct CLI command estimates a job it will run in its own process (app/commands/
# kinds.py preflight): then this machine's figures apply, not the queue's workers'.
_here: contextvars.ContextVar[bool] = contextvars.ContextVar("fisherlens_estimate_here", default=False)
# How long the web keeps the workers table it read (one estimate reads it several times)
WORKERS_CACHE_S = 2.0
_workers_cache: dict[str, tuple[float, list[dict[str, Any]]]] = {}


@contextlib.contextmanager
def here() -> Iterator[None]:
    """Estimates inside are for a job run in this process, on this machine's device."""
    token = _here.set(True)
    try:
        yield
    finally:
        _here.reset(token)


def worker_devices(settings: Any) -> list[dict[str, Any]]:
    """The live workers' device rows (storage/workers.py: what each one's device offers a job),
    [] inside `here()`, without a database, or when it cannot be read (then the web's own
    figures apply, as before workers wrote them)."""
    if _here.get() or not getattr(settings, "db_url", None):
        return []
    now = time.monotonic()
    got = _workers_cache.get(settings.db_url)
    if got is not None and now - got[0] < WORKERS_CACHE_S:
        return got[1]
    try:
        from sqlalchemy.engine import make_url

        from storage import workers
        from storage.db import session_factory

        url = make_url(settings.db_url)
        if url.get_backend_name() == "sqlite" and not (url.database and Path(url.database).exists()):
            rows: list[dict[str, Any]] = []  # no database yet (a direct CLI run's home): no workers
        else:
            with session_factory(settings.db_url)() as s:
                rows = workers.live(session=s)
    except Exception:  # noqa: BLE001 - no table yet, database away: the web's own figures
        rows = []
    _workers_cache[settings.db_url] = (now, rows)
    return rows


def calibration(settings: Any) -> tuple[float, float, str] | None:
    """(a, b, where it comes from) of the calibrated cost model seconds = token_passes x (a + b x
    params) (compute.lm.calibrate; `fisherlens calibrate` writes FISHERLENS_HOME/throughput.json):
    the live workers' own (worker_devices: the slowest of those that measured theirs; not under
    an operator's THROUGHPUT_FILE), else the first readable of THROUGHPUT_FILE,
    FISHERLENS_HOME/throughput.json and the committed
    benchmarks/results/throughput.json (the reference machine's calibration, REFERENCE: a machine
    with none of its own is priced by it, and the estimate says so). None under an explicit
    THROUGHPUT, or when the first readable file holds only that one constant (an operator's
    benchmark file of the earlier form): then the one constant applies."""
    if settings.throughput:
        return None
    # the queue's workers measured their own devices: the slowest prices a job (it may run there)
    measured = [w for w in worker_devices(settings)
                if w["seconds_per_token_pass"] is not None and w["seconds_per_param_token_pass"] is not None]
    if measured and settings.throughput_file is None:
        w = max(measured, key=lambda w: (w["seconds_per_param_token_pass"], w["seconds_per_token_pass"]))
        return (float(w["seconds_per_token_pass"]), float(w["seconds_per_param_token_pass"]),
                f"worker {w['name']}, {w['device']}")
    for path in (settings.throughput_file, settings.home / "throughput.json", REPO_THROUGHPUT):
        if path is None:
            continue
        try:
            got = _read_calibration(str(path), Path(path).stat().st_mtime)
        except OSError:
            continue
        if got is not None:
            return got[0], got[1], REFERENCE if Path(path) == REPO_THROUGHPUT else str(Path(path).name)
        if _throughput_file(Path(path)) is not None:
            return None
    return None


def calibration_text(cal: tuple[float, float, str]) -> str:
    """Where a calibration (calibration()'s value) comes from, as an estimate states it."""
    return _reference_text() if cal[2] == REFERENCE else f"calibrated ({cal[2]})"


def _reference_text() -> str:
    try:
        data = json.loads(REPO_THROUGHPUT.read_text())
    except (OSError, ValueError):
        data = {}
    where = data.get("device_name") or data.get("device") or "?"
    cpus = data.get("cpus")
    machine = f"{where} with {cpus} cores" if cpus and data.get("device") == "cpu" else str(where)
    return (f"the reference machine's calibration, {machine} (benchmarks/results/throughput.json); "
            "not this machine's: `fisherlens calibrate` measures it in seconds")


@functools.lru_cache(maxsize=8)
def _read_calibration(path: str, mtime: float) -> tuple[float, float] | None:
    from compute.contract.cost import read_calibration

    got = read_calibration(path)
    return None if got is None else (got[0], got[1])


def seconds_of(settings: Any, token_passes: float, params: int) -> tuple[float, str] | None:
    """Estimated run time of `token_passes` over a model of `params` parameters, and the model it
    comes from: the calibration of this machine when there is one, else cost / throughput."""
    cal = calibration(settings)
    if cal is not None:
        return max(token_passes, 1) * (cal[0] + cal[1] * params), calibration_text(cal)
    tp = throughput(settings)
    if tp is None:
        return None
    # no calibration of this machine: one constant measured elsewhere, off by up to two orders of
    # magnitude at either end of the model sizes (docs/lab.md); the text says how to do better
    return max(token_passes, 1) * params / tp[0], (f"{tp[0]:.3g} parameter-token-passes/s ({tp[1]}); "
                                                   "not this machine's: `fisherlens calibrate` measures it in seconds")


def _throughput_file(path: Path) -> float | None:
    try:
        return _read_throughput(str(path), path.stat().st_mtime)
    except OSError:
        return None


@functools.lru_cache(maxsize=8)
def _read_throughput(path: str, mtime: float) -> float | None:
    try:
        value = json.loads(Path(path).read_text()).get("param_token_passes_per_s")
    except (OSError, ValueError, AttributeError):
        return None
    return float(value) if isinstance(value, int | float) and value > 0 else None


def job_ceiling(
    settings: Any, *, is_admin: bool, max_job_cost: float | None, max_job_seconds: float | None
) -> tuple[float | None, float | None]:
    """(cost ceiling, the run-time limit it comes from in seconds, or None) for a user with
    these per-user values. Precedence: the user's cost ceiling, the user's time limit, the role's
    cost ceiling (MAX_JOB_COST[_ADMIN]), the role's time limit (MAX_JOB_SECONDS[_ADMIN]); a time
    limit becomes a cost ceiling at the measured throughput."""
    if max_job_cost is not None:
        return float(max_job_cost), None
    role_cost = settings.max_job_cost_admin if is_admin else settings.max_job_cost
    seconds = max_job_seconds
    if seconds is None:
        if role_cost is not None:
            return float(role_cost), None
        seconds = settings.max_job_seconds_admin if is_admin else settings.max_job_seconds
    if seconds is None:
        return None, None
    tp = throughput(settings)
    if tp is None:
        return (float(role_cost) if role_cost is not None else None), None
    return float(seconds) * tp[0], float(seconds)


def duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"
