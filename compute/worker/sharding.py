"""Fan-out of a job into child jobs and the combine at the end, for every kind whose module
implements compute/jobs/runners.py's child protocol (children / run_child / combine).

    run_job(parent)  -> fan_out: n child rows (storage.fanout.create_children), n run_shard msgs
    run_shard(child) -> run_child(spec, index) -> the output saved as the child's artifact
                        "shard" (shard.pt); the child that completes the set wins
                        repo.request_combine and sends the one finish_shards message
    finish_shards(parent) -> repo.claim_combine (one delivery wins) -> combine(spec, outputs)
"""

from __future__ import annotations

import logging
from typing import Any

from compute.jobs.runners import child_protocol, dump_output, load_output
from compute.runtime.celery_app import FINISH_SHARDS, RUN_SHARD, send_job
from compute.runtime.control import fault_point
from compute.worker import lifecycle
from compute.worker.lifecycle import (
    Claimed,
    JobProgress,
    claim,
    compute_and_store,
    fail,
    keep_alive,
    sessions,
)
from compute.worker.refs import fetch_refs
from storage import repo
from storage.artifacts import ArtifactInfo, open_store
from storage.models import FINAL_STATUSES

log = logging.getLogger("fisherlens.worker")

OUTPUT_KIND = "shard"  # artifact kind of a child's output
OUTPUT_FILE = "shard.pt"


def fan_out(settings: Any, job_id: int, n: int) -> str:
    """Create every child row in one transaction (a re-delivery reuses them) and queue those
    still queued. The parent stays `running` with no worker; the child that completes the set
    queues finish_shards (and the reconciler does, if that message is lost)."""
    with sessions(settings)() as s:
        children = repo.create_children(session=s, parent_id=job_id, n=n)
        todo = [c.id for c in children if c.status == "queued"]
    for k, cid in enumerate(todo):
        send_job(settings, cid, task=RUN_SHARD)
        if k == 0:
            fault_point("during_fanout", f"job={job_id}")  # tests only: rows made, sends partial
    if not todo:
        maybe_finish(settings, job_id)
    return f"fanned out {len(children)} children"


def maybe_finish(settings: Any, parent_id: int) -> bool:
    """Send finish_shards if every child succeeded and this caller won repo.request_combine
    (two children finishing together: exactly one sends it)."""
    with sessions(settings)() as s:
        if not repo.request_combine(session=s, parent_id=parent_id):
            return False
    send_job(settings, parent_id, task=FINISH_SHARDS)
    return True


def _save_output(settings: Any, job_id: int, output: Any) -> ArtifactInfo:
    store = open_store(settings)
    return store.save_bytes(job_id, OUTPUT_FILE, dump_output(output), kind=OUTPUT_KIND)


def execute_shard(settings: Any, job_id: int, hostname: str | None = None) -> str:
    """Run one child unit (run_child of its parent's spec) and store its output."""
    from compute.contract.jobresult import JobResult
    from compute.jobs.registry import parse_spec

    fault_point("after_receive", f"job={job_id}")  # tests only (compute.runtime.control)
    taken = claim(settings, job_id, hostname or lifecycle.hostname(settings))
    if isinstance(taken, str):
        return taken
    fault_point("after_claim", f"job={job_id}")

    def compute(progress: JobProgress) -> Any:
        protocol = child_protocol(taken.kind)
        if protocol is None:
            raise TypeError(f"kind {taken.kind!r} has child jobs but no child protocol")
        spec = parse_spec(taken.kind, taken.spec)
        refs = fetch_refs(settings, job_id, taken.refs)  # the parent's, copied at fan-out
        progress(0.0, f"child {taken.index}")
        output = protocol.run_child(spec, taken.index, progress, refs=refs)
        info = _save_output(settings, job_id, output)
        return JobResult(kind=taken.kind, summary={"shard": taken.index}), [info]

    outcome = compute_and_store(settings, job_id, compute, "running", parent_id=taken.parent_id)
    if outcome == "succeeded" and taken.parent_id is not None:
        maybe_finish(settings, taken.parent_id)
    return outcome


def execute_finish(settings: Any, job_id: int, hostname: str | None = None) -> str:
    """Combine the children's outputs into the parent's result (one delivery: claim_combine)."""
    hostname = hostname or lifecycle.hostname(settings)
    with sessions(settings)() as s:
        job = repo.get_job(session=s, job_id=job_id)
        if job is None or job.status in FINAL_STATUSES:
            return "skipped"
        if not repo.claim_combine(
            session=s, parent_id=job_id, worker=hostname, stale_after_s=settings.job_stale_after_s
        ):
            log.info("finish of job %s skipped: not all children done, or already combining", job_id)
            return "claimed elsewhere"
        children = repo.shard_jobs(session=s, parent_id=job_id)
        arts = [repo.get_artifact(session=s, job_id=c.id, kind=OUTPUT_KIND) for c in children]
        taken = Claimed(job_id, job.kind, dict(job.spec), None, 0, job.refs)
    try:
        with keep_alive(settings, job_id):  # imports torch and the kind's module, reads files
            spec, protocol, outputs = _load_outputs(settings, taken, children, arts)
            refs = fetch_refs(settings, job_id, taken.refs)
    except Exception as exc:
        log.exception("finish of job %s failed", job_id)
        fail(settings, job_id, exc)
        return "failed"
    return compute_and_store(
        settings, job_id, lambda progress: protocol.combine(spec, outputs, progress, refs=refs),
        "combining"
    )


def _load_outputs(settings: Any, taken: Claimed, children: list[Any], arts: list[Any]) -> Any:
    """(spec, protocol, [output of child 0, 1, ...]) read back from the children's artifacts."""
    from compute.jobs.registry import parse_spec

    protocol = child_protocol(taken.kind)
    if protocol is None:
        raise TypeError(f"kind {taken.kind!r} has child jobs but no child protocol")
    spec = parse_spec(taken.kind, taken.spec)
    store = open_store(settings)
    outputs = []
    for child, art in zip(children, arts, strict=True):
        if art is None:
            raise ValueError(f"child {child.shard_index} (job {child.id}): its output is missing")
        blob = store.fetch(art.path, art.sha256).read_bytes()
        outputs.append(load_output(blob))
    return spec, protocol, outputs
