"""One job row's life in a worker: claim it, heartbeat and progress while it runs, store its
result, and end it (succeeded, cancelled, failed). Every state change is a storage/ function;
the ones two processes may race on are compare-and-sets there (repo.claim_job, ...).

A database outage costs nothing but time: while the database is unreachable a running job goes
on computing (its progress writes and cancel checks are skipped), and a claim or the recording of
a job's end (result rows, final state) waits for the database and is then written as it was
(`until_db`): no job is failed for it, run again or charged another attempt, and the worker takes
no new work meanwhile (Celery holds the message unacked until the task returns)."""

from __future__ import annotations

import logging
import os
import re
import shutil
import socket
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from compute.contract.jobresult import JobCancelled
from compute.runtime.control import cancel_scope, fault_point
from storage import repo
from storage.artifacts import on_uploaded, open_store, upload_retries
from storage.db import is_outage, session_factory
from storage.models import FINAL_STATUSES, Job, utcnow

log = logging.getLogger("fisherlens.worker")

# The default of Settings.fisherlens_max_attempts (FISHERLENS_MAX_ATTEMPTS): a lost job is re-run
# once. Code reads the setting (settings.fisherlens_max_attempts), never the environment.
MAX_ATTEMPTS = 2
_DIGITS = re.compile(r"\d+(\.\d+)?")
PROGRESS_EVERY_S = 0.5  # progress writes and cancel checks hit the database at most this often
DB_RETRY_MAX_S = 5.0  # while the database is away, retry a write at least this often

# Default names carry the pid, so a worker can tell a dead sibling on its own host from a live one.
_PID_NAME = re.compile(r"^(?:worker|gpu\d+|embedded)-(\d+)@(.+)$")


def default_worker_name(prefix: str = "worker", pid: int | None = None) -> str:
    """`<prefix>-<pid>@<host>`: unique per process on a host (two `fisherlens worker` on one
    machine never share a name), and checkable (a process of this host that is gone is dead)."""
    return f"{prefix}-{pid or os.getpid()}@{socket.gethostname()}"


def hostname(settings: Any | None = None) -> str:
    """Settings.fisherlens_worker_name (FISHERLENS_WORKER_NAME), else `<worker>-<pid>@<host>`."""
    if settings is None:
        from compute.contract.settings import get_settings

        settings = get_settings()
    return settings.fisherlens_worker_name or default_worker_name()


def sessions(settings: Any) -> Any:
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


def holder_dead(settings: Any, worker: str | None, heartbeat: datetime | None) -> bool:
    """Is the worker holding a running job gone? Its heartbeat is older than JOB_STALE_AFTER_S,
    or its name says it is a process of this host that no longer exists."""
    cutoff = utcnow() - timedelta(seconds=settings.job_stale_after_s)
    if heartbeat is None or heartbeat < cutoff:
        return True
    m = _PID_NAME.match(worker or "")
    if m and m.group(2) == socket.gethostname():
        return not _pid_alive(int(m.group(1)))
    return False


def until_db(what: str, fn: Callable[[], Any]) -> Any:
    """fn() (database work that must happen: a claim, a job's result and end), retried while
    the database is unreachable (storage.db.is_outage), every DB_RETRY_MAX_S at most, for as
    long as the outage lasts; any other error is raised at once. The job's outcome is held in
    this process meanwhile and recorded as it was once the database is back."""
    delay, since = 0.25, None
    while True:
        try:
            out = fn()
        except Exception as exc:
            if not is_outage(exc):
                raise
            if since is None:
                since = time.monotonic()
                log.warning("database unreachable (%s); %s waits for it", type(exc).__name__, what)
            time.sleep(delay)
            delay = min(delay * 2, DB_RETRY_MAX_S)
            continue
        if since is not None:
            log.warning("database back after %.0f s; %s done", time.monotonic() - since, what)
        return out


# -- progress and heartbeat -------------------------------------------------------------------
class JobProgress:
    """progress(fraction, message): throttled writes to the job row; raises JobCancelled when
    the user asked to cancel (this job or, for a child, its parent). For a child it also
    refreshes the parent's progress. `check(force)` is the cancel check behind
    compute.runtime.control.cancel_point()."""

    def __init__(self, settings: Any, job_id: int, parent_id: int | None = None):
        self.settings = settings
        self.job_id = job_id
        self.parent_id = parent_id
        self._last = float("-inf")
        self._last_check = float("-inf")
        self._moved = False
        self._message = "\0"  # no stage yet
        self._db_away = False

    def __call__(self, fraction: float, message: str = "") -> None:
        now = time.monotonic()
        # A new stage (the message without its counts: "loading the weights", "sampling i/n") is
        # always written: a throttled stage name would stay on screen through the next, long one.
        new_stage = _DIGITS.sub("", message) != _DIGITS.sub("", self._message)
        if now - self._last < PROGRESS_EVERY_S and fraction < 1.0 and not new_stage:
            return
        self._last = self._last_check = now
        self._message = message
        try:
            with sessions(self.settings)() as s:
                cancel = repo.update_progress(
                    session=s, job_id=self.job_id, fraction=fraction, message=message
                )
                if self.parent_id is not None:
                    repo.refresh_parent_progress(session=s, parent_id=self.parent_id)
                    cancel = cancel or self._parent_cancelled(s)
        except Exception as exc:
            if not is_outage(exc):
                raise
            cancel = self._outage(exc)  # the job goes on; progress resumes with the database
        if cancel:
            raise JobCancelled(f"job {self.job_id} cancelled by the user")
        if fraction > 0 and not self._moved:
            self._moved = True
            if fault_point("mid_job", f"job={self.job_id}"):  # tests only (compute.runtime.control)
                self.check(force=True)

    def check(self, force: bool = False) -> None:
        """Raise JobCancelled if a cancel was requested (reads the row at most every
        PROGRESS_EVERY_S unless force); also a heartbeat."""
        now = time.monotonic()
        if not force and now - self._last_check < PROGRESS_EVERY_S:
            return
        self._last_check = now
        try:
            with sessions(self.settings)() as s:
                cancel = repo.heartbeat(session=s, job_id=self.job_id)
                if self.parent_id is not None:
                    cancel = cancel or self._parent_cancelled(s)
        except Exception as exc:
            if not is_outage(exc):
                raise
            cancel = self._outage(exc)
        if cancel:
            raise JobCancelled(f"job {self.job_id} cancelled by the user")

    def _outage(self, exc: BaseException) -> bool:
        """The database is away: log it once per outage; no cancel can have been asked."""
        if not self._db_away:
            self._db_away = True
            log.warning("job %s: database unreachable (%s); computing on, progress not recorded "
                        "until it is back", self.job_id, type(exc).__name__)
        return False

    def _parent_cancelled(self, s: Any) -> bool:
        parent = repo.get_job(session=s, job_id=self.parent_id) if self.parent_id else None
        return bool(parent and parent.cancel_requested)


@contextmanager
def keep_alive(settings: Any, job_id: int) -> Iterator[None]:
    """Touch heartbeat_at every few seconds while the job runs, even inside long calls that do
    not report progress (model loading, the first import of torch), so other workers know this
    one is alive. Everything a worker does between a claim and the job's end runs inside one."""
    stop = threading.Event()
    every = max(1.0, min(30.0, settings.job_stale_after_s / 5))

    def beat() -> None:
        while not stop.wait(every):
            try:
                with sessions(settings)() as s:
                    repo.heartbeat(session=s, job_id=job_id)
            except Exception as exc:  # a DB hiccup must not kill the job
                if is_outage(exc):
                    log.warning("heartbeat for job %s: database unreachable", job_id)
                else:
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
    trained-model folders they return can be moved, not copied: into the artifact folder, or
    into the local cache of an object store); removed afterwards."""
    root = open_store(settings).scratch_root()
    root.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=f"job{job_id}-", dir=root))
    old = tempfile.tempdir
    tempfile.tempdir = str(path)
    try:
        yield path
    finally:
        tempfile.tempdir = old
        shutil.rmtree(path, ignore_errors=True)


# -- claiming a job ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Claimed:
    """What a delivery needs of the job row it claimed (rows are re-fetched, never passed)."""

    job_id: int
    kind: str
    spec: dict[str, Any]
    parent_id: int | None
    index: int
    refs: dict[str, Any] | None = None  # jobs.refs: the references resolved at submit


def _skip_reason(settings: Any, s: Any, job: Job | None, worker: str) -> str | None:
    """Decide whether this delivery runs the job: returns None to run, or why it is skipped."""
    if job is None:
        return "no such job"
    if job.status in FINAL_STATUSES:
        return f"already {job.status}"
    if job.status == "running" and job.worker != worker:
        hb = job.heartbeat_at or job.started_at
        if hb is not None and hb > utcnow() - timedelta(seconds=settings.job_stale_after_s):
            return f"running on {job.worker}"
    if job.cancel_requested:
        # what really happened: a job that had started (a worker died or was killed while it
        # ran, after the cancel was asked) did run, it was not "cancelled before it ran"
        ran = job.started_at is not None or (job.attempts or 0) > 0
        repo.mark_cancelled(session=s, job_id=job.id, message=(
            f"cancelled; it had started {job.attempts or 1} time(s) and its worker stopped before "
            "it could end it (killed, or out of memory)" if ran else "cancelled before it ran"))
        return "cancelled"
    if job.attempts >= settings.fisherlens_max_attempts:
        repo.mark_failed(
            session=s,
            job_id=job.id,
            error=f"worker lost: the job was started {job.attempts} times and its worker died "
            "each time (out of memory? killed?); giving up",
            message=f"worker lost {job.attempts} times; giving up",
        )
        return "gave up"
    if job.parent_id is not None:
        parent = repo.get_job(session=s, job_id=job.parent_id)
        if parent is None or parent.status in FINAL_STATUSES:
            repo.mark_cancelled(session=s, job_id=job.id, message="parent job ended")
            return "parent ended"
    return None


def claim(settings: Any, job_id: int, worker: str) -> Claimed | str:
    """Take the job for this delivery (repo.claim_job, a compare-and-set), or say why not;
    waits for the database while it is unreachable."""
    return until_db(f"the claim of job {job_id}", lambda: _claim(settings, job_id, worker))


def _claim(settings: Any, job_id: int, worker: str) -> Claimed | str:
    with sessions(settings)() as s:
        job = repo.get_job(session=s, job_id=job_id)
        skip = _skip_reason(settings, s, job, worker)
        if skip is not None:
            log.info("job %s skipped: %s", job_id, skip)
            return skip
        assert job is not None
        taken = Claimed(job_id, job.kind, dict(job.spec), job.parent_id, int(job.shard_index or 0),
                        job.refs)
        claimed = repo.claim_job(
            session=s, job_id=job_id, worker=worker, stale_after_s=settings.job_stale_after_s
        )
    if claimed is None:
        log.info("job %s skipped: claimed by another delivery", job_id)
        return "claimed elsewhere"
    log.info("job %s claimed by %s", job_id, worker)
    return taken


def fail(settings: Any, job_id: int, exc: BaseException) -> None:
    """End the job `failed` with the error's text; a child's failure fails its parent (waits
    for the database while it is unreachable)."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    until_db(f"recording the failure of job {job_id}", lambda: _fail(settings, job_id, exc, text))


def _fail(settings: Any, job_id: int, exc: BaseException, text: str) -> None:
    with sessions(settings)() as s:
        repo.mark_failed(
            session=s, job_id=job_id, error=text, message=f"{type(exc).__name__}: {exc}"[:500]
        )
        job = repo.get_job(session=s, job_id=job_id)
        if job is not None and job.parent_id is not None:
            repo.fail_parent(
                session=s,
                parent_id=job.parent_id,
                message=f"child {job.shard_index} (job {job.id}) failed: {type(exc).__name__}: {exc}",
            )


def compute_and_store(
    settings: Any,
    job_id: int,
    compute: Callable[[JobProgress], Any],
    phase: str,
    parent_id: int | None = None,
) -> str:
    """Run `compute(progress)` under a heartbeat and a cancel scope, store the JobResult it
    returns (with the artifacts it lists in `progress.artifacts`), and end the job row:
    succeeded, cancelled (JobCancelled from progress or a cancel point) or failed (any other
    error, with its text). For a child, the parent's progress is refreshed."""
    try:
        progress = JobProgress(settings, job_id, parent_id=parent_id)
        with keep_alive(settings, job_id), _scratch(settings, job_id), _store_waits(settings, progress):
            with cancel_scope(progress.check):
                result, artifacts = _unpack(compute(progress))
            if parent_id is None:  # a child's partial output has no result schema of its own
                result.to_dict()  # checks the kind's result contract; a ContractError fails the job

            until_db(f"storing the result of job {job_id}",
                     lambda: _publish(settings, job_id, result, artifacts, progress))
        until_db(f"recording the end of job {job_id}", lambda: _succeeded(settings, job_id, parent_id))
        log.info("job %s succeeded", job_id)
        return "succeeded"
    except JobCancelled:
        until_db(f"recording the cancel of job {job_id}", lambda: _cancelled(settings, job_id, phase))
        log.info("job %s cancelled while %s", job_id, phase)
        return "cancelled"
    except Exception as exc:
        log.exception("job %s failed while %s", job_id, phase)
        fail(settings, job_id, exc)
        return "failed"
    finally:
        try:  # cached artifacts this job read may be evicted again
            open_store(settings).release()
        except Exception:
            log.exception("releasing the artifact cache after job %s failed", job_id)


def _publish(settings: Any, job_id: int, result: Any, artifacts: list[Any],
             progress: JobProgress) -> None:
    """Upload the result's artifacts, then record them and the rows (repo.save_result): the
    database names an artifact only once it is stored and verified. An object store that
    cannot be reached is retried for ARTIFACT_UPLOAD_RETRY_S (the job's message says so; the
    computed result is kept, nothing is recomputed); a cancel stops the waiting."""
    with sessions(settings)() as s:
        repo.save_result(session=s, job_id=job_id, result=result, store=open_store(settings),
                         artifacts=artifacts)


def _store_waits(settings: Any, progress: JobProgress) -> Any:
    """The context in which a job's uploads run: transient store errors retried (each wait shown
    as the job's message, with a cancel check), and the test-only fault point `artifact_uploaded`
    after the first object a job uploads (compute.runtime.control)."""

    def notify(message: str) -> None:
        with sessions(settings)() as s:
            cancel = repo.update_progress(session=s, job_id=progress.job_id, fraction=None,
                                          message=message)
        if cancel:
            raise JobCancelled(f"job {progress.job_id} cancelled by the user")

    stack = ExitStack()
    stack.enter_context(upload_retries(settings.artifact_upload_retry_s, notify))
    stack.enter_context(on_uploaded(lambda key: fault_point("artifact_uploaded", key)))
    return stack


def _succeeded(settings: Any, job_id: int, parent_id: int | None) -> None:
    with sessions(settings)() as s:
        repo.mark_succeeded(session=s, job_id=job_id)
        if parent_id is not None:
            repo.refresh_parent_progress(session=s, parent_id=parent_id)


def _cancelled(settings: Any, job_id: int, phase: str) -> None:
    with sessions(settings)() as s:
        repo.mark_cancelled(session=s, job_id=job_id, message=f"cancelled while {phase}")
        job = repo.get_job(session=s, job_id=job_id)
        if job is not None and job.parent_id is not None:
            parent = repo.get_job(session=s, job_id=job.parent_id)
            if parent is not None and not parent.cancel_requested:
                repo.fail_parent(session=s, parent_id=job.parent_id,
                                 message=f"child {job.shard_index} (job {job.id}) was cancelled")


def _unpack(out: Any) -> tuple[Any, list[Any]]:
    """compute() returns a JobResult, or (JobResult, [ArtifactInfo, ...]) for prepared files."""
    if isinstance(out, tuple):
        return out[0], list(out[1])
    return out, []
