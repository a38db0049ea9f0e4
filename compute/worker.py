"""Celery worker adapters: the only compute module that imports storage and celery.

Each task is a thin adapter (take a job id, load, call one pure compute function, save):
  fisherlens.run_job(job_id)        any job kind; a fisher spec with shards > 1 fans out
  fisherlens.run_shard(job_id)      one prompt range of a sharded fisher job (a child job row)
  fisherlens.finish_shards(job_id)  sums the shards' partial results into the parent's result

Nothing stuck, nothing run twice:
- acks_late + reject_on_worker_lost + prefetch 1 + solo pool (compute/celery_app);
- every delivery first takes the job with the atomic `repo.claim_job` (compare-and-set), so a
  duplicate or re-sent message is harmless: it finds the job claimed or finished and does nothing;
- a heartbeat thread while a job runs; cancel is checked at every progress call and at every
  `compute.control.cancel_point()` (each sampling step, forward chunk, model load);
- `reconcile()` runs in every worker at start-up and every RECONCILE_INTERVAL_S: jobs of dead
  workers (stale heartbeat, a dead process of this host, or this worker's own name at start-up)
  are re-queued once or failed; `queued` jobs whose message is in no queue (lost with a killed
  consumer, a restarted Redis, an interrupted fan-out) are re-sent (on Redis a message a dead
  consumer held unacked is restored with kombu's own `restore_by_tag`); sharded parents whose
  shards all succeeded are finished, and failed when a shard did not succeed;
- default worker names are unique per process (`worker-<pid>@<host>`), so two workers on one
  host never take each other for dead.

Run: `fisherlens worker` (or `celery -A compute.worker:celery_app worker --pool solo`).
"""

from __future__ import annotations

import base64
import json
import logging
import os
import re
import socket
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from celery import signals

import compute.celery_app as ca
from compute.celery_app import FINISH_SHARDS, RUN_JOB, RUN_SHARD, make_celery, send_job
from compute.contract.settings import get_settings
from compute.control import cancel_scope, fault_point
from compute.results import JobCancelled
from compute.specs import FisherSpec
from storage import repo
from storage.artifacts import ArtifactStore
from storage.db import session_factory, upgrade
from storage.models import FINAL_STATUSES, Job, utcnow

log = logging.getLogger("fisherlens.worker")

MAX_ATTEMPTS = int(os.environ.get("FISHERLENS_MAX_ATTEMPTS", "2"))  # a lost job is re-run once
PROGRESS_EVERY_S = 0.5  # progress writes and cancel checks hit the database at most this often
# Spec fields naming another job's artifact: kind -> {field: artifact kind}.
REF_FIELDS = {"mask": {"fisher": "fisher"}, "train": {"mask": "mask"}, "diff": {"fisher": "fisher"}}

celery_app = make_celery(get_settings())

# Default names carry the pid, so a worker can tell a dead sibling on its own host from a live one.
_PID_NAME = re.compile(r"^(?:worker|gpu\d+|embedded)-(\d+)@(.+)$")


def default_worker_name(prefix: str = "worker", pid: int | None = None) -> str:
    """`<prefix>-<pid>@<host>`: unique per process on a host (two `fisherlens worker` on one
    machine never share a name), and checkable (a process of this host that is gone is dead)."""
    return f"{prefix}-{pid or os.getpid()}@{socket.gethostname()}"


def _hostname() -> str:
    return os.environ.get("FISHERLENS_WORKER_NAME") or default_worker_name()


def _sessions(settings: Any) -> Any:
    return session_factory(settings.db_url)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (exited, not yet reaped) is dead
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except (OSError, IndexError):
        return True


def _holder_dead(settings: Any, worker: str | None, heartbeat: datetime | None) -> bool:
    """Is the worker holding a running job gone? Its heartbeat is older than JOB_STALE_AFTER_S,
    or its name says it is a process of this host that no longer exists."""
    cutoff = utcnow() - timedelta(seconds=settings.job_stale_after_s)
    if heartbeat is None or heartbeat < cutoff:
        return True
    m = _PID_NAME.match(worker or "")
    if m and m.group(2) == socket.gethostname():
        return not _pid_alive(int(m.group(1)))
    return False


# -- progress and heartbeat -------------------------------------------------------------------
class JobProgress:
    """progress(fraction, message): throttled writes to the job row; raises JobCancelled when
    the user asked to cancel. For a shard it also refreshes the parent's progress.
    `check(force)` is the cancel check behind compute.control.cancel_point()."""

    def __init__(self, settings: Any, job_id: int, parent_id: int | None = None):
        self.settings = settings
        self.job_id = job_id
        self.parent_id = parent_id
        self._last = float("-inf")
        self._last_check = float("-inf")
        self._moved = False

    def __call__(self, fraction: float, message: str = "") -> None:
        now = time.monotonic()
        if now - self._last < PROGRESS_EVERY_S and fraction < 1.0:
            return
        self._last = self._last_check = now
        with _sessions(self.settings)() as s:
            cancel = repo.update_progress(
                session=s, job_id=self.job_id, fraction=fraction, message=message
            )
            if self.parent_id is not None:
                _refresh_parent_progress(s, self.parent_id)
                cancel = cancel or self._parent_cancelled(s)
        if cancel:
            raise JobCancelled(f"job {self.job_id} cancelled by the user")
        if fraction > 0 and not self._moved:
            self._moved = True
            if fault_point("mid_job", f"job={self.job_id}"):  # tests only (compute.control)
                self.check(force=True)

    def check(self, force: bool = False) -> None:
        """Raise JobCancelled if a cancel was requested (reads the row at most every
        PROGRESS_EVERY_S unless force); also a heartbeat."""
        now = time.monotonic()
        if not force and now - self._last_check < PROGRESS_EVERY_S:
            return
        self._last_check = now
        with _sessions(self.settings)() as s:
            cancel = repo.heartbeat(session=s, job_id=self.job_id)
            if self.parent_id is not None:
                cancel = cancel or self._parent_cancelled(s)
        if cancel:
            raise JobCancelled(f"job {self.job_id} cancelled by the user")

    def _parent_cancelled(self, s: Any) -> bool:
        parent = repo.get_job(session=s, job_id=self.parent_id) if self.parent_id else None
        return bool(parent and parent.cancel_requested)


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
    fault_point("after_receive", f"job={job_id}")  # tests only (compute.control)
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
    log.info("job %s claimed by %s", job_id, hostname)
    fault_point("after_claim", f"job={job_id}")
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
    settings: Any,
    job_id: int,
    compute: Callable[[JobProgress], Any],
    phase: str,
    parent_id: int | None = None,
    artifacts: list[Any] | None = None,
) -> str:
    """Run `compute(progress)` under a heartbeat and a cancel scope, store its JobResult, and
    end the job row: succeeded, cancelled (JobCancelled from progress or a cancel point) or
    failed (any other error, with its text)."""
    try:
        progress = JobProgress(settings, job_id, parent_id=parent_id)
        with _heartbeat(settings, job_id), _scratch(settings, job_id):
            with cancel_scope(progress.check):
                result = compute(progress)
            with _sessions(settings)() as s:
                repo.save_result(
                    session=s,
                    job_id=job_id,
                    result=result,
                    store=ArtifactStore(settings.artifacts_dir),
                    artifacts=artifacts,
                )
        with _sessions(settings)() as s:
            repo.mark_succeeded(session=s, job_id=job_id)
            if parent_id is not None:
                _refresh_parent_progress(s, parent_id)
        log.info("job %s succeeded", job_id)
        return "succeeded"
    except JobCancelled:
        with _sessions(settings)() as s:
            repo.mark_cancelled(session=s, job_id=job_id, message=f"cancelled while {phase}")
        log.info("job %s cancelled while %s", job_id, phase)
        return "cancelled"
    except Exception as exc:
        log.exception("job %s failed while %s", job_id, phase)
        _fail(settings, job_id, exc)
        return "failed"


def _fan_out(settings: Any, job_id: int, spec: Any) -> str:
    """Create every shard's child job row in one transaction (a re-delivery reuses them) and queue
    those still queued. The parent stays `running` with no worker; the shard that completes the
    set queues finish_shards (and the reconciler does, if that message is lost)."""
    with _sessions(settings)() as s:
        children = repo.create_shards(
            session=s,
            parent_id=job_id,
            n=spec.shards,
            spec=spec.model_dump(mode="json"),
            spec_hash=spec.spec_hash(),
        )
        todo = [c.id for c in children if c.status == "queued"]
    for k, cid in enumerate(todo):
        send_job(settings, cid, task=RUN_SHARD)
        if k == 0:
            fault_point("during_fanout", f"job={job_id}")  # tests only: rows made, sends partial
    if not todo:
        _maybe_finish(settings, job_id)
    return f"fanned out {len(children)} shards"


def execute_shard(settings: Any, job_id: int, hostname: str | None = None) -> str:
    from compute.results import JobResult
    from compute.run_fisher import run_shard

    hostname = hostname or _hostname()
    fault_point("after_receive", f"job={job_id}")
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
    log.info("shard job %s claimed by %s", job_id, hostname)
    fault_point("after_claim", f"job={job_id}")
    saved: list[Any] = []

    def compute(progress: JobProgress) -> Any:
        import io

        import torch

        spec = FisherSpec.model_validate(spec_data)
        progress(0.0, f"shard {index}")
        out = run_shard(spec, index, progress)
        buf = io.BytesIO()
        torch.save(out, buf)
        saved.append(
            ArtifactStore(settings.artifacts_dir).save_bytes(
                job_id, "shard.pt", buf.getvalue(), kind="shard"
            )
        )
        return JobResult(kind="fisher", summary={"shard": index})

    outcome = _compute_and_store(
        settings, job_id, compute, "running", parent_id=parent_id, artifacts=saved
    )
    if outcome == "succeeded" and parent_id is not None:
        _maybe_finish(settings, parent_id)
    return outcome


def _shards_complete(parent: Job, shards: list[Job]) -> bool:
    n = int((parent.spec or {}).get("shards", len(shards)) or 0)
    return bool(shards) and len(shards) >= n and all(j.status == "succeeded" for j in shards)


def _maybe_finish(settings: Any, parent_id: int) -> bool:
    """Queue finish_shards when every shard of the parent succeeded and nobody is combining yet.
    Two shards finishing together may both queue it: the finisher's atomic claim
    (repo.claim_finish) lets one delivery run and makes the other a no-op."""
    with _sessions(settings)() as s:
        parent = repo.get_job(session=s, job_id=parent_id)
        if parent is None or parent.status != "running" or parent.worker is not None:
            return False
        if not _shards_complete(parent, repo.shard_jobs(session=s, parent_id=parent_id)):
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
        shards = repo.shard_jobs(session=s, parent_id=job_id)
        if not _shards_complete(job, shards):
            return "shards not done"
        if not repo.claim_finish(
            session=s, job_id=job_id, worker=hostname, stale_after_s=settings.job_stale_after_s
        ):
            log.info("finish of job %s skipped: another delivery is combining it", job_id)
            return "claimed elsewhere"
        arts = [repo.get_artifact(session=s, job_id=c.id, kind="shard") for c in shards]
        spec_data = dict(job.spec)
    try:
        spec = FisherSpec.model_validate(spec_data)
        outputs = []
        for child, art in zip(shards, arts, strict=True):
            if art is None:
                raise ValueError(f"shard {child.shard_index}: its partial result is missing")
            blob = store.verify(art.path, art.sha256).read_bytes()
            outputs.append(torch.load(io.BytesIO(blob), weights_only=True, map_location="cpu"))
    except Exception as exc:
        log.exception("finish of job %s failed", job_id)
        _fail(settings, job_id, exc)
        return "failed"
    return _compute_and_store(
        settings, job_id, lambda progress: finish(spec, outputs, progress), "combining"
    )


# -- reconciliation: nothing stuck -------------------------------------------------------------
def _task_of(job: Job) -> str:
    return RUN_SHARD if job.parent_id is not None else RUN_JOB


def _parse_message(payload: Any) -> tuple[str, int] | None:
    """(task name, job id) of a Celery (protocol 2) message as kombu stores it, or None."""
    try:
        task = payload["headers"]["task"]
        body = payload["body"]
        if payload.get("properties", {}).get("body_encoding") == "base64":
            body = base64.b64decode(body)
        args = json.loads(body)[0]
        return str(task), int(args[0])
    except (KeyError, IndexError, TypeError, ValueError):
        return None


class BrokerView:
    """The messages of our queue that the broker holds: waiting in the queue, and (Redis) held
    unacked by a consumer, with how long ago it took them. On the filesystem transport a taken
    message leaves the folder (there is no unacked store), so only waiting ones are seen."""

    def __init__(self, settings: Any):
        self.settings = settings
        self.waiting: set[tuple[str, int]] = set()
        self.unacked: dict[tuple[str, int], list[tuple[str, float]]] = {}

    def load(self) -> BrokerView:
        queue = ca.QUEUE
        if not self.settings.redis_url:
            folder = Path(self.settings.queue_dir) / "messages"
            for f in folder.glob(f"*.{queue}.msg") if folder.is_dir() else []:
                try:
                    key = _parse_message(json.loads(f.read_text()))
                except (OSError, ValueError):
                    continue  # taken (moved) while we looked, or being written
                if key:
                    self.waiting.add(key)
            return self
        with ca.celery_for(self.settings).connection_for_write() as conn:
            ch = conn.default_channel
            client = ch.client
            for pri in ch.priority_steps:
                for raw in client.lrange(ch._q_for_pri(queue, pri), 0, -1):
                    key = _parse_message(json.loads(raw))
                    if key:
                        self.waiting.add(key)
            now = time.time()
            since = dict(client.zrange(ch.unacked_index_key, 0, -1, withscores=True))
            for tag, raw in client.hgetall(ch.unacked_key).items():
                try:
                    payload, _exchange, routing_key = json.loads(raw)
                except (ValueError, TypeError):
                    continue
                key = _parse_message(payload)
                if routing_key != queue or key is None:
                    continue
                tag_s = tag.decode() if isinstance(tag, bytes) else str(tag)
                age = now - float(since.get(tag, now))
                self.unacked.setdefault(key, []).append((tag_s, age))
        return self

    def restore(self, tags: list[str]) -> None:
        """Put messages a dead consumer held back on their queue (kombu's own restore)."""
        if not tags:
            return
        with ca.celery_for(self.settings).connection_for_write() as conn:
            ch = conn.default_channel
            for tag in tags:
                ch.qos.restore_by_tag(tag, client=ch.client)


def _pending(view: BrokerView, key: tuple[str, int], after: float) -> bool:
    """Is this message waiting in the queue, or held by a consumer that took it less than
    `after` seconds ago (so its claim is on the way)?"""
    held = view.unacked.get(key, [])
    return key in view.waiting or any(age < after for _, age in held)


def _resend(settings: Any, view: BrokerView, task: str, job_id: int) -> str:
    """Send a job's message again; on Redis, restore the one a dead consumer held, if any."""
    held = [tag for tag, _ in view.unacked.get((task, job_id), [])]
    if held:
        view.restore(held)
        return "restored"
    send_job(settings, job_id, task=task)
    return "re-sent"


def reconcile(
    settings: Any, hostname: str | None = None, view: BrokerView | None = None
) -> list[tuple[int, str]]:
    """One pass of the reconciler (every worker: at start-up with its own name as `hostname`,
    then every RECONCILE_INTERVAL_S with hostname=None). Returns [(job id, action)].

    1. Running jobs (not sharded parents) whose worker is dead (stale heartbeat, a process of this
       host that is gone, or, at start-up, this worker's own name) go back to `queued` (attempts
       left) or `failed`: a compare-and-set on (worker, attempts), so two reconcilers never both
       act and a job claimed again in between is left alone.
    2. Sharded parents: missing shard rows are created (a fan-out cut short); all shards succeeded
       and nobody combining (or its finisher dead) -> finish_shards again; a shard failed or was
       cancelled -> the parent fails.
    3. Queued jobs whose message went out more than RECONCILE_QUEUED_AFTER_S ago and that no
       queue holds (nor a consumer that took it less than that ago) are re-sent, once per period
       for all workers together (repo.mark_resent).
    Every re-send is harmless: a delivery runs a job only after the atomic claim."""
    view = view or BrokerView(settings).load()  # broker away: raise, nothing changed
    actions: list[tuple[int, str]] = []
    sends: list[tuple[str, int]] = []  # steps 1 and 2
    lost: list[tuple[str, int]] = []  # step 3
    after = float(settings.reconcile_queued_after_s)
    with _sessions(settings)() as s:
        running = repo.list_jobs(session=s, status="running", include_shards=True, limit=1000)
        for job in sorted(running, key=lambda j: j.id):
            shards = repo.shard_jobs(session=s, parent_id=job.id)
            if shards:
                acts, more = _reconcile_parent(settings, s, view, job, shards, after)
                actions += acts
                sends += more
                continue
            if not (
                (hostname is not None and job.worker == hostname)
                or _holder_dead(settings, job.worker, job.heartbeat_at or job.started_at)
            ):
                continue
            who = job.worker or "unknown worker"
            requeue = job.attempts < MAX_ATTEMPTS
            if requeue:
                message = f"re-queued: worker {who} was lost (attempt {job.attempts})"
                error = None
            else:
                message = f"worker lost after {job.attempts} attempt(s)"
                error = f"worker lost: {who} died while running this job, {job.attempts} attempt(s); giving up"
            if not repo.release_lost(
                session=s,
                job_id=job.id,
                worker=job.worker,
                attempts=job.attempts,
                requeue=requeue,
                message=message,
                error=error,
            ):
                continue
            if requeue:
                sends.append((_task_of(job), job.id))
                actions.append((job.id, "requeued"))
            else:
                actions.append((job.id, "failed"))
                if job.parent_id is not None:
                    _fail_parent(s, job.parent_id, f"shard {job.shard_index}: worker lost")
        for job in repo.find_queued(session=s, older_than_s=after):
            key = (_task_of(job), job.id)
            if key in sends or _pending(view, key, after):
                continue
            if repo.mark_resent(session=s, job_id=job.id, older_than_s=after):
                lost.append(key)
    for task, job_id in sends:
        how = _resend(settings, view, task, job_id)
        log.info("job %s: message %s (%s)", job_id, how, task)
    for task, job_id in lost:
        actions.append((job_id, _resend(settings, view, task, job_id)))
    for job_id, action in actions:
        log.warning("reconciled job %s: %s", job_id, action)
    return actions


def _reconcile_parent(
    settings: Any, s: Any, view: BrokerView, parent: Job, shards: list[Job], after: float
) -> tuple[list[tuple[int, str]], list[tuple[str, int]]]:
    """Step 2 of reconcile for one running sharded parent: (actions, messages to send)."""
    n = int((parent.spec or {}).get("shards", len(shards)) or 0)
    hb = parent.heartbeat_at or parent.created_at
    if parent.worker is None:
        idle = hb < utcnow() - timedelta(seconds=after)
    else:
        idle = _holder_dead(settings, parent.worker, hb)
    if len(shards) < n and idle:  # a fan-out cut short (rows of older versions, one by one)
        spec = FisherSpec.model_validate(dict(parent.spec))
        have = {j.id for j in shards}
        rows = repo.create_shards(
            session=s,
            parent_id=parent.id,
            n=n,
            spec=spec.model_dump(mode="json"),
            spec_hash=spec.spec_hash(),
        )
        return [(parent.id, "fan-out completed")], [
            (RUN_SHARD, j.id) for j in rows if j.id not in have
        ]
    if any(j.status in ("queued", "running") for j in shards):
        return [], []  # shards still to run: step 3 re-sends any whose message is lost
    if any(j.status != "succeeded" for j in shards):
        _fail_parent(s, parent.id, "a shard did not succeed")
        return [(parent.id, "failed")], []
    if len(shards) < n or not idle or _pending(view, (FINISH_SHARDS, parent.id), after):
        return [], []
    return [(parent.id, "finishing")], [(FINISH_SHARDS, parent.id)]


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
        reconcile(settings, hostname=hostname)
    except Exception:
        log.exception("start-up reconcile failed")
    _start_reconciler(settings)


_reconciler_stop = threading.Event()


def _start_reconciler(settings: Any) -> None:
    """While this worker lives, reconcile every RECONCILE_INTERVAL_S (a thread: it runs while the
    solo pool is busy with a job), so a lost message or a dead worker is noticed even when no
    worker restarts."""
    every = float(settings.reconcile_interval_s)

    def loop() -> None:
        while not _reconciler_stop.wait(every):
            try:
                reconcile(settings, hostname=None)
            except Exception:  # broker or database away: try again next period
                log.exception("reconcile failed")

    threading.Thread(target=loop, name="fisherlens-reconciler", daemon=True).start()


@signals.worker_shutdown.connect
def _on_worker_shutdown(**_: Any) -> None:
    _reconciler_stop.set()


def worker_argv(name: str | None = None, loglevel: str = "INFO") -> list[str]:
    """argv for celery_app.worker_main: one solo worker (one per GPU), our queue only."""
    argv = ["worker", "--pool=solo", "--concurrency=1", "-Q", ca.QUEUE, f"--loglevel={loglevel}"]
    argv += ["--without-mingle", "--without-gossip"]
    argv += ["-n", name or _hostname()]
    return argv
