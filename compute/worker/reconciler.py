"""Nothing stuck: every worker reconciles the job table with the broker at start-up and then
every RECONCILE_INTERVAL_S (see `reconcile`). Every action it takes is a compare-and-set in
storage, and every message it re-sends is harmless (a delivery runs a job only after its claim)."""

from __future__ import annotations

import base64
import json
import logging
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import compute.runtime.celery_app as ca
from compute.runtime.celery_app import FINISH_SHARDS, RUN_JOB, RUN_SHARD, send_job
from compute.worker.lifecycle import holder_dead, sessions
from storage import repo
from storage.db import is_outage
from storage.models import FINAL_STATUSES, Job, utcnow

log = logging.getLogger("fisherlens.worker")

Key = tuple[str, int]  # (task name, job id) of a message


def _task_of(job: Job) -> str:
    return RUN_SHARD if job.parent_id is not None else RUN_JOB


def _parse_message(payload: Any) -> Key | None:
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
        self.waiting: set[Key] = set()
        self.unacked: dict[Key, list[tuple[str, float]]] = {}

    def load(self) -> BrokerView:
        if not self.settings.redis_url:
            self._load_folder(Path(self.settings.queue_dir) / "messages", ca.queue_name(self.settings))
            return self
        with ca.celery_for(self.settings).connection_for_write() as conn:
            ch = conn.default_channel
            for pri in ch.priority_steps:
                for raw in ch.client.lrange(ch._q_for_pri(ca.queue_name(self.settings), pri), 0, -1):
                    key = _parse_message(json.loads(raw))
                    if key:
                        self.waiting.add(key)
            self._load_unacked(ch, ca.queue_name(self.settings))
        return self

    def _load_folder(self, folder: Path, queue: str) -> None:
        for f in folder.glob(f"*.{queue}.msg") if folder.is_dir() else []:
            try:
                key = _parse_message(json.loads(f.read_text()))
            except (OSError, ValueError):
                continue  # taken (moved) while we looked, or being written
            if key:
                self.waiting.add(key)

    def _load_unacked(self, ch: Any, queue: str) -> None:
        now = time.time()
        since = dict(ch.client.zrange(ch.unacked_index_key, 0, -1, withscores=True))
        for tag, raw in ch.client.hgetall(ch.unacked_key).items():
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

    def restore(self, tags: list[str]) -> None:
        """Put messages a dead consumer held back on their queue (kombu's own restore)."""
        if not tags:
            return
        with ca.celery_for(self.settings).connection_for_write() as conn:
            ch = conn.default_channel
            for tag in tags:
                ch.qos.restore_by_tag(tag, client=ch.client)


    def drop(self, tags: list[str]) -> None:
        """Forget messages held unacked for jobs that have ended (Redis only): what the
        consumer's ack would have done, so they are not restored hours later."""
        if not tags or not self.settings.redis_url:
            return
        with ca.celery_for(self.settings).connection_for_write() as conn:
            ch = conn.default_channel
            for tag in tags:
                ch.client.hdel(ch.unacked_key, tag)
                ch.client.zrem(ch.unacked_index_key, tag)


def _pending(view: BrokerView, key: Key, after: float) -> bool:
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

    1. Running jobs (not parents of children) whose worker is dead (stale heartbeat, a process of
       this host that is gone, or, at start-up, this worker's own name) go back to `queued`
       (attempts left) or `failed`: a compare-and-set on (worker, attempts), so two reconcilers
       never both act and a job claimed again in between is left alone.
    2. Parents of children (see `_reconcile_parent`): a child failed -> the parent fails; all
       succeeded and the combine not requested, its message lost, or its combiner dead ->
       finish_shards again (each a compare-and-set on jobs.combine_state).
    3. Queued jobs whose message went out more than RECONCILE_QUEUED_AFTER_S ago and that no
       queue holds (nor a consumer that took it less than that ago) are re-sent, once per period
       for all workers together (repo.mark_resent).
    4. (Redis) messages held unacked for longer than RECONCILE_QUEUED_AFTER_S whose job has
       ended (or does not exist) are dropped, as their ack would have: a consumer killed before
       its ack, or a message restored after its job was re-sent, no longer waits for the
       visibility timeout to be delivered again and skipped."""
    view = view or BrokerView(settings).load()  # broker away: raise, nothing changed
    actions: list[tuple[int, str]] = []
    sends: list[Key] = []  # steps 1 and 2
    lost: list[Key] = []  # step 3
    after = float(settings.reconcile_queued_after_s)
    with sessions(settings)() as s:
        running = repo.list_jobs(session=s, status="running", include_shards=True, limit=1000)
        for job in sorted(running, key=lambda j: j.id):
            children = repo.shard_jobs(session=s, parent_id=job.id)
            if children:
                acts, more = _reconcile_parent(settings, s, view, job, children, after)
            else:
                acts, more = _release_if_lost(settings, s, job, hostname)
            actions += acts
            sends += more
        for job in repo.find_queued(session=s, older_than_s=after):
            key = (_task_of(job), job.id)
            if key in sends or _pending(view, key, after):
                continue
            if repo.mark_resent(session=s, job_id=job.id, older_than_s=after):
                lost.append(key)
        ended = _ended_messages(s, view, after)
    view.drop(ended)
    for task, job_id in sends:
        how = _resend(settings, view, task, job_id)
        log.info("job %s: message %s (%s)", job_id, how, task)
    for task, job_id in lost:
        actions.append((job_id, _resend(settings, view, task, job_id)))
    for job_id, action in actions:
        log.warning("reconciled job %s: %s", job_id, action)
    return actions


def _ended_messages(s: Any, view: BrokerView, after: float) -> list[str]:
    """Step 4 of reconcile: tags of unacked messages, held longer than `after`, of ended jobs."""
    tags = []
    for (_task, job_id), held in view.unacked.items():
        old = [tag for tag, age in held if age > after]
        if not old:
            continue
        job = repo.get_job(session=s, job_id=job_id)
        if job is None or job.status in FINAL_STATUSES:
            tags += old
    return tags


Outcome = tuple[list[tuple[int, str]], list[Key]]  # (actions, messages to send)


def _release_if_lost(settings: Any, s: Any, job: Job, hostname: str | None) -> Outcome:
    """Step 1 of reconcile for one running job without children."""
    mine = hostname is not None and job.worker == hostname
    if not (mine or holder_dead(settings, job.worker, job.heartbeat_at or job.started_at)):
        return [], []
    who = job.worker or "unknown worker"
    requeue = job.attempts < settings.fisherlens_max_attempts
    if requeue:
        message, error = f"re-queued: worker {who} was lost (attempt {job.attempts})", None
    else:
        message = f"worker lost after {job.attempts} attempt(s)"
        error = f"worker lost: {who} died while running this job, {job.attempts} attempt(s); giving up"
    if not repo.release_lost(
        session=s, job_id=job.id, worker=job.worker, attempts=job.attempts,
        requeue=requeue, message=message, error=error,
    ):
        return [], []
    if requeue:
        return [(job.id, "requeued")], [(_task_of(job), job.id)]
    if job.parent_id is not None:
        repo.fail_parent(session=s, parent_id=job.parent_id,
                         message=f"child {job.shard_index} (job {job.id}): {error}")
    return [(job.id, "failed")], []


def _reconcile_parent(
    settings: Any, s: Any, view: BrokerView, parent: Job, children: list[Job], after: float
) -> Outcome:
    """Step 2 of reconcile for one running parent of child jobs."""
    n = repo.expected_children(parent, children)
    hb = parent.heartbeat_at or parent.created_at
    if len(children) < n and hb < utcnow() - timedelta(seconds=after):
        have = {j.id for j in children}  # a fan-out cut short (rows of older versions)
        rows = repo.create_children(session=s, parent_id=parent.id, n=n)
        return [(parent.id, "fan-out completed")], [(RUN_SHARD, j.id) for j in rows if j.id not in have]
    if any(j.status in ("queued", "running") for j in children):
        return [], []  # children still to run: step 3 re-sends any whose message is lost
    bad = next((j for j in children if j.status != "succeeded"), None)
    if bad is not None:
        message = f"child {bad.shard_index} (job {bad.id}) {bad.status}: {bad.message}"
        repo.fail_parent(session=s, parent_id=parent.id, message=message)
        return [(parent.id, "failed")], []
    finish: Outcome = [(parent.id, "finishing")], [(FINISH_SHARDS, parent.id)]
    if parent.combine_state is None:  # the child that completed the set did not request it
        return finish if repo.request_combine(session=s, parent_id=parent.id) else ([], [])
    if _pending(view, (FINISH_SHARDS, parent.id), after):
        return [], []
    if parent.combine_state == "queued":  # its finish message is lost
        ok = repo.mark_combine_resent(session=s, parent_id=parent.id, older_than_s=after)
        return finish if ok else ([], [])
    if holder_dead(settings, parent.worker, hb):  # 'running': the combiner died
        ok = repo.release_combine(session=s, parent_id=parent.id, worker=parent.worker)
        return finish if ok else ([], [])
    return [], []


_stop = threading.Event()


def start_reconciler(settings: Any, beat: Any = None) -> None:
    """While this worker lives, reconcile every RECONCILE_INTERVAL_S (a thread: it runs while the
    solo pool is busy with a job), so a lost message or a dead worker is noticed even when no
    worker restarts. `beat()`, when given, runs first each period (the worker's device row is
    kept seen: compute/worker/device.py)."""
    every = float(settings.reconcile_interval_s)

    def loop() -> None:
        while not _stop.wait(every):
            if beat is not None:
                beat()
            try:
                reconcile(settings, hostname=None)
            except Exception as exc:  # broker or database away: try again next period
                if is_outage(exc):
                    log.warning("reconcile skipped: database unreachable (%s)", type(exc).__name__)
                else:
                    log.exception("reconcile failed")

    threading.Thread(target=loop, name="fisherlens-reconciler", daemon=True).start()


def stop_reconciler() -> None:
    _stop.set()
