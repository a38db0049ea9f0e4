"""Celery worker adapters: the only compute module that imports storage and celery.

Each task is a thin adapter (take a job id, load, call one pure compute function, save):
  fisherlens.run_job(job_id)        any job kind; a fisher spec with shards > 1 fans out
  fisherlens.run_shard(job_id)      one prompt range of a sharded fisher job (a child job row)
  fisherlens.finish_shards(job_id)  sums the shards' partial results into the parent's result

Nothing is lost: acks_late + reject_on_worker_lost + prefetch 1 + solo pool (compute/celery_app),
a heartbeat thread while a job runs, and on start-up `recover()` re-queues (once) or fails the
jobs a dead worker left `running`. Tasks are idempotent: a re-delivered job replaces its rows.

Run: `fisherlens worker` (or `celery -A compute.worker:celery_app worker --pool solo`).
"""

from __future__ import annotations

import logging
import os
import socket
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

from celery import signals
from sqlalchemy import update

from app.settings import get_settings
from compute.celery_app import FINISH_SHARDS, QUEUE, RUN_JOB, RUN_SHARD, make_celery, send_job
from compute.results import JobCancelled
from compute.specs import FisherSpec
from storage import repo
from storage.artifacts import ArtifactStore
from storage.db import session_factory, upgrade
from storage.models import FINAL_STATUSES, Job, utcnow

log = logging.getLogger("fisherlens.worker")

MAX_ATTEMPTS = int(os.environ.get("FISHERLENS_MAX_ATTEMPTS", "2"))  # a lost job is re-run once
PROGRESS_EVERY_S = 0.5
# Spec fields naming another job's artifact: kind -> {field: artifact kind}.
REF_FIELDS = {"mask": {"fisher": "fisher"}, "train": {"mask": "mask"}, "diff": {"fisher": "fisher"}}

celery_app = make_celery(get_settings())


def _hostname() -> str:
    return os.environ.get("FISHERLENS_WORKER_NAME") or f"celery@{socket.gethostname()}"


def _sessions(settings: Any) -> Any:
    return session_factory(settings.db_url)


# -- progress and heartbeat -------------------------------------------------------------------
class JobProgress:
    """progress(fraction, message): throttled writes to the job row; raises JobCancelled when
    the user asked to cancel. For a shard it also refreshes the parent's progress."""

    def __init__(self, settings: Any, job_id: int, parent_id: int | None = None):
        self.settings = settings
        self.job_id = job_id
        self.parent_id = parent_id
        self._last = 0.0

    def __call__(self, fraction: float, message: str = "") -> None:
        now = time.monotonic()
        if now - self._last < PROGRESS_EVERY_S and fraction < 1.0:
            return
        self._last = now
        with _sessions(self.settings)() as s:
            cancel = repo.update_progress(
                session=s, job_id=self.job_id, fraction=fraction, message=message
            )
            if self.parent_id is not None:
                _refresh_parent_progress(s, self.parent_id)
                parent = repo.get_job(session=s, job_id=self.parent_id)
                cancel = cancel or bool(parent and parent.cancel_requested)
        if cancel:
            raise JobCancelled(f"job {self.job_id} cancelled by the user")


def _refresh_parent_progress(s: Any, parent_id: int) -> None:
    shards = repo.shard_jobs(session=s, parent_id=parent_id)
    if shards:
        mean = sum(1.0 if j.status == "succeeded" else j.progress for j in shards) / len(shards)
        done = sum(j.status == "succeeded" for j in shards)
        repo.update_progress(
            session=s,
            job_id=parent_id,
            fraction=0.95 * mean,
            message=f"{done}/{len(shards)} shards done",
        )


@contextmanager
def _heartbeat(settings: Any, job_id: int) -> Iterator[None]:
    """Touch heartbeat_at every few seconds while the job runs, even inside long calls that do
    not report progress (model loading), so other workers know this one is alive."""
    stop = threading.Event()
    every = max(1.0, min(30.0, settings.job_stale_after_s / 5))

    def beat() -> None:
        while not stop.wait(every):
            try:
                with _sessions(settings)() as s:
                    repo.heartbeat(session=s, job_id=job_id)
            except Exception:  # a DB hiccup must not kill the job
                log.exception("heartbeat for job %s failed", job_id)

    t = threading.Thread(target=beat, name=f"heartbeat-{job_id}", daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(timeout=5)


@contextmanager
def _scratch(settings: Any, job_id: int) -> Iterator[Path]:
    """A per-job temp folder on the artifact file system (runners' tempfile.* land here, so the
    trained-model folders they return can be moved, not copied); removed afterwards."""
    root = Path(settings.artifacts_dir) / ".scratch"
    root.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=f"job{job_id}-", dir=root))
    old = tempfile.tempdir
    tempfile.tempdir = str(path)
    try:
        yield path
    finally:
        tempfile.tempdir = old
        import shutil

        shutil.rmtree(path, ignore_errors=True)


# -- claiming a job ---------------------------------------------------------------------------
def _claim(settings: Any, s: Any, job: Job | None, hostname: str) -> str | None:
    """Decide whether this delivery runs the job: returns None to run, or why it is skipped."""
    if job is None:
        return "no such job"
    if job.status in FINAL_STATUSES:
        return f"already {job.status}"
    if job.status == "running" and job.worker != hostname:
        hb = job.heartbeat_at or job.started_at
        if hb is not None and hb > utcnow() - timedelta(seconds=settings.job_stale_after_s):
            return f"running on {job.worker}"
    if job.cancel_requested:
        repo.mark_cancelled(session=s, job_id=job.id, message="cancelled before it ran")
        return "cancelled"
    if job.attempts >= MAX_ATTEMPTS:
        repo.mark_failed(
            session=s,
            job_id=job.id,
            error=f"worker lost: the job was started {job.attempts} times and its worker died "
            "each time (out of memory? killed?); giving up",
            message=f"worker lost {job.attempts} times; giving up",
        )
        return "gave up"
    return None


def _resolve_refs(settings: Any, s: Any, kind: str, spec: Any) -> Any:
    """Check every 'job:<id>' of the spec (model, teacher, base, tuned, fisher, mask) with
    compute.modelref, the resolver the API validated it with; the spec keeps the references
    (the compute code resolves them again where it reads the files)."""
    from compute.modelref import check_spec_refs

    return check_spec_refs(kind, spec, settings, s)


def _fail(settings: Any, job_id: int, exc: BaseException) -> None:
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    with _sessions(settings)() as s:
        repo.mark_failed(
            session=s, job_id=job_id, error=text, message=f"{type(exc).__name__}: {exc}"[:500]
        )
        job = repo.get_job(session=s, job_id=job_id)
        if job is not None and job.parent_id is not None:
            _fail_parent(s, job.parent_id, f"shard {job.shard_index} failed: {exc}")


def _fail_parent(s: Any, parent_id: int, message: str) -> None:
    parent = repo.get_job(session=s, job_id=parent_id)
    if parent is not None and parent.status not in FINAL_STATUSES:
        repo.mark_failed(session=s, job_id=parent_id, error=message, message=message[:500])
        for j in repo.shard_jobs(session=s, parent_id=parent_id):
            if j.status == "queued":
                repo.mark_cancelled(session=s, job_id=j.id, message="sibling shard failed")


# -- the job task -----------------------------------------------------------------------------
def execute_job(settings: Any, job_id: int, hostname: str | None = None) -> str:
    """Run one job to a final state (or fan a sharded fisher job out). Returns what happened."""
    from compute.runners import get_runner
    from compute.specs import parse_spec

    hostname = hostname or _hostname()
    with _sessions(settings)() as s:
        job = repo.get_job(session=s, job_id=job_id)
        skip = _claim(settings, s, job, hostname)
        if skip is not None:
            log.info("job %s skipped: %s", job_id, skip)
            return skip
        assert job is not None
        kind, spec_data = job.kind, dict(job.spec)
        if (
            repo.claim_job(
                session=s, job_id=job_id, worker=hostname, stale_after_s=settings.job_stale_after_s
            )
            is None
        ):
            log.info("job %s skipped: claimed by another delivery", job_id)
            return "claimed elsewhere"
    try:
        spec = parse_spec(kind, spec_data)
        if kind == "fisher" and getattr(spec, "shards", 1) > 1:
            return _fan_out(settings, job_id, spec)
        with _sessions(settings)() as s:
            spec = _resolve_refs(settings, s, kind, spec)
    except Exception as exc:
        log.exception("job %s failed", job_id)
        _fail(settings, job_id, exc)
        return "failed"

    def compute(progress: JobProgress) -> Any:
        progress(0.0, "loading")
        return get_runner(kind)(spec, progress)

    return _compute_and_store(settings, job_id, compute, "running")


def _compute_and_store(
    settings: Any, job_id: int, compute: Callable[[JobProgress], Any], phase: str
) -> str:
    """Run `compute(progress)` under a heartbeat, store its JobResult, and end the job row:
    succeeded, cancelled (JobCancelled from progress) or failed (any other error, with its text)."""
    try:
        progress = JobProgress(settings, job_id)
        with _heartbeat(settings, job_id), _scratch(settings, job_id):
            result = compute(progress)
            with _sessions(settings)() as s:
                repo.save_result(
                    session=s,
                    job_id=job_id,
                    result=result,
                    store=ArtifactStore(settings.artifacts_dir),
                )
        with _sessions(settings)() as s:
            repo.mark_succeeded(session=s, job_id=job_id)
        return "succeeded"
    except JobCancelled:
        with _sessions(settings)() as s:
            repo.mark_cancelled(session=s, job_id=job_id, message=f"cancelled while {phase}")
        return "cancelled"
    except Exception as exc:
        log.exception("job %s failed while %s", job_id, phase)
        _fail(settings, job_id, exc)
        return "failed"


def _fan_out(settings: Any, job_id: int, spec: Any) -> str:
    """Create one child job per shard (once: a re-delivery reuses them) and queue those not done.
    The parent stays `running`; the shard that completes the set queues finish_shards."""
    with _sessions(settings)() as s:
        children = repo.shard_jobs(session=s, parent_id=job_id)
        if not children:
            for i in range(spec.shards):
                repo.create_job(
                    session=s,
                    kind="fisher",
                    spec=spec.model_dump(mode="json"),
                    spec_hash=spec.spec_hash(),
                    model_revision=None,
                    parent_id=job_id,
                    shard_index=i,
                )
            children = repo.shard_jobs(session=s, parent_id=job_id)
        s.execute(update(Job).where(Job.id == job_id).values(worker=None))
        repo.update_progress(
            session=s, job_id=job_id, fraction=0.0, message=f"0/{spec.shards} shards done"
        )
        todo = [c.id for c in children if c.status != "succeeded"]
        s.commit()
    for cid in todo:
        send_job(settings, cid, task=RUN_SHARD)
    if not todo:
        _maybe_finish(settings, job_id)
    return f"fanned out {len(children)} shards"


def execute_shard(settings: Any, job_id: int, hostname: str | None = None) -> str:
    from compute.run_fisher import run_shard

    hostname = hostname or _hostname()
    with _sessions(settings)() as s:
        job = repo.get_job(session=s, job_id=job_id)
        skip = _claim(settings, s, job, hostname)
        if skip is None and job is not None and job.parent_id is not None:
            parent = repo.get_job(session=s, job_id=job.parent_id)
            if parent is None or parent.status in FINAL_STATUSES:
                repo.mark_cancelled(session=s, job_id=job_id, message="parent job ended")
                skip = "parent ended"
        if skip is not None:
            log.info("shard job %s skipped: %s", job_id, skip)
            return skip
        assert job is not None
        parent_id, index, spec_data = job.parent_id, int(job.shard_index or 0), dict(job.spec)
        if (
            repo.claim_job(
                session=s, job_id=job_id, worker=hostname, stale_after_s=settings.job_stale_after_s
            )
            is None
        ):
            log.info("shard job %s skipped: claimed by another delivery", job_id)
            return "claimed elsewhere"
    try:
        import io

        import torch

        spec = FisherSpec.model_validate(spec_data)
        progress = JobProgress(settings, job_id, parent_id=parent_id)
        with _heartbeat(settings, job_id), _scratch(settings, job_id):
            progress(0.0, f"shard {index}")
            out = run_shard(spec, index, progress)
            buf = io.BytesIO()
            torch.save(out, buf)
            info = ArtifactStore(settings.artifacts_dir).save_bytes(
                job_id, "shard.pt", buf.getvalue(), kind="shard"
            )
        from compute.results import JobResult

        with _sessions(settings)() as s:
            repo.save_result(
                session=s,
                job_id=job_id,
                result=JobResult(kind="fisher", summary={"shard": index}),
                artifacts=[info],
            )
            repo.mark_succeeded(session=s, job_id=job_id)
            if parent_id is not None:
                _refresh_parent_progress(s, parent_id)
        if parent_id is not None:
            _maybe_finish(settings, parent_id)
        return "succeeded"
    except JobCancelled:
        with _sessions(settings)() as s:
            repo.mark_cancelled(session=s, job_id=job_id, message="cancelled while running")
        return "cancelled"
    except Exception as exc:
        log.exception("shard job %s failed", job_id)
        _fail(settings, job_id, exc)
        return "failed"


def _maybe_finish(settings: Any, parent_id: int) -> bool:
    """Queue finish_shards exactly once, when every shard succeeded (compare-and-set on the
    parent's message, so two shards finishing together queue it once)."""
    with _sessions(settings)() as s:
        shards = repo.shard_jobs(session=s, parent_id=parent_id)
        if not shards or any(j.status != "succeeded" for j in shards):
            return False
        res = s.execute(
            update(Job)
            .where(Job.id == parent_id, Job.status == "running", Job.message != "combining shards")
            .values(message="combining shards", heartbeat_at=utcnow())
        )
        s.commit()
        if res.rowcount != 1:
            return False
    send_job(settings, parent_id, task=FINISH_SHARDS)
    return True


def execute_finish(settings: Any, job_id: int, hostname: str | None = None) -> str:
    import io

    import torch

    from compute.run_fisher import finish

    hostname = hostname or _hostname()
    store = ArtifactStore(settings.artifacts_dir)
    with _sessions(settings)() as s:
        job = repo.get_job(session=s, job_id=job_id)
        if job is None or job.status in FINAL_STATUSES:
            return "skipped"
        spec = FisherSpec.model_validate(dict(job.spec))
        outputs = []
        for child in repo.shard_jobs(session=s, parent_id=job_id):
            art = repo.get_artifact(session=s, job_id=child.id, kind="shard")
            if child.status != "succeeded" or art is None:
                return f"shard {child.shard_index} not done"
            blob = store.verify(art.path, art.sha256).read_bytes()
            outputs.append(torch.load(io.BytesIO(blob), weights_only=True, map_location="cpu"))
        s.execute(update(Job).where(Job.id == job_id).values(worker=hostname))
        s.commit()
    return _compute_and_store(
        settings, job_id, lambda progress: finish(spec, outputs, progress), "combining"
    )


# -- recovery of jobs left by dead workers ------------------------------------------------------
def recover(settings: Any, hostname: str | None = None) -> list[tuple[int, str]]:
    """Jobs left `running` by a dead worker (stale heartbeat, or claimed by `hostname`, the name
    of the worker now starting) are re-queued if they have attempts left, else marked failed.
    Sharded parents whose shards all ended are finished or failed. Returns [(job id, action)]."""
    actions: list[tuple[int, str]] = []
    sends: list[tuple[int, str]] = []
    with _sessions(settings)() as s:
        for job in repo.find_stale_running(
            session=s, stale_after_s=settings.job_stale_after_s, hostname=hostname
        ):
            who = job.worker or "unknown worker"
            if job.attempts < MAX_ATTEMPTS:
                repo.requeue(
                    session=s,
                    job_id=job.id,
                    message=f"re-queued: worker {who} was lost (attempt {job.attempts})",
                )
                sends.append((job.id, RUN_SHARD if job.parent_id else RUN_JOB))
                actions.append((job.id, "requeued"))
            else:
                repo.mark_failed(
                    session=s,
                    job_id=job.id,
                    error=f"worker lost: {who} died while running this job, "
                    f"{job.attempts} attempt(s); giving up",
                    message=f"worker lost after {job.attempts} attempt(s)",
                )
                actions.append((job.id, "failed"))
                if job.parent_id is not None:
                    _fail_parent(s, job.parent_id, f"shard {job.shard_index}: worker lost")
        # Sharded parents: finish when all shards succeeded, fail when one ended badly.
        cutoff = utcnow() - timedelta(seconds=settings.job_stale_after_s)
        for parent in repo.list_jobs(session=s, status="running", limit=1000):
            shards = repo.shard_jobs(session=s, parent_id=parent.id)
            if not shards or any(j.status in ("queued", "running") for j in shards):
                continue
            if all(j.status == "succeeded" for j in shards):
                if (parent.heartbeat_at or parent.created_at) > cutoff:
                    continue  # being finished now (finish_shards keeps the heartbeat fresh)
                s.execute(
                    update(Job)
                    .where(Job.id == parent.id)
                    .values(message="combining shards", heartbeat_at=utcnow())
                )
                s.commit()
                sends.append((parent.id, FINISH_SHARDS))
                actions.append((parent.id, "finishing"))
            else:
                _fail_parent(s, parent.id, "a shard did not succeed")
                actions.append((parent.id, "failed"))
    for job_id, task in sends:
        send_job(settings, job_id, task=task)
    for job_id, action in actions:
        log.warning("recovered job %s: %s", job_id, action)
    return actions


# -- Celery wiring ----------------------------------------------------------------------------
@celery_app.task(name=RUN_JOB, bind=True, acks_late=True, reject_on_worker_lost=True)
def run_job(self: Any, job_id: int) -> str:
    return execute_job(get_settings(), int(job_id), hostname=self.request.hostname)


@celery_app.task(name=RUN_SHARD, bind=True, acks_late=True, reject_on_worker_lost=True)
def run_shard_task(self: Any, job_id: int) -> str:
    return execute_shard(get_settings(), int(job_id), hostname=self.request.hostname)


@celery_app.task(name=FINISH_SHARDS, bind=True, acks_late=True, reject_on_worker_lost=True)
def finish_shards_task(self: Any, job_id: int) -> str:
    return execute_finish(get_settings(), int(job_id), hostname=self.request.hostname)


@signals.worker_init.connect
def _on_worker_init(**_: Any) -> None:
    upgrade(get_settings().db_url)


@signals.worker_ready.connect
def _on_worker_ready(sender: Any = None, **_: Any) -> None:
    hostname = getattr(sender, "hostname", None) or _hostname()
    settings = get_settings()
    try:
        recover(settings, hostname=hostname)
    except Exception:
        log.exception("start-up recovery failed")
    _start_reaper(settings)


_reaper_stop = threading.Event()


def _start_reaper(settings: Any) -> None:
    """While this worker lives, look for jobs whose worker died (stale heartbeat) every half
    stale period, so a crash is noticed even when no worker restarts on that machine."""
    every = max(2.0, settings.job_stale_after_s / 2)

    def loop() -> None:
        while not _reaper_stop.wait(every):
            try:
                recover(settings, hostname=None)
            except Exception:
                log.exception("stale-job check failed")

    threading.Thread(target=loop, name="fisherlens-reaper", daemon=True).start()


@signals.worker_shutdown.connect
def _on_worker_shutdown(**_: Any) -> None:
    _reaper_stop.set()


def worker_argv(name: str | None = None, loglevel: str = "INFO") -> list[str]:
    """argv for celery_app.worker_main: one solo worker (one per GPU), our queue only."""
    argv = ["worker", "--pool=solo", "--concurrency=1", "-Q", QUEUE, f"--loglevel={loglevel}"]
    argv += ["--without-mingle", "--without-gossip"]
    if name:
        argv += ["-n", name]
    return argv
