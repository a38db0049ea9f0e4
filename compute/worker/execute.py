"""fisherlens.run_job's body: claim the job, then run it inline or fan it out into children."""

from __future__ import annotations

import logging
from typing import Any

from compute.runtime.control import fault_point
from compute.worker import lifecycle
from compute.worker.lifecycle import (
    JobProgress,
    claim,
    compute_and_store,
    fail,
    keep_alive,
)
from compute.worker.refs import fetch_refs, snapshot, unchanged
from compute.worker.sharding import fan_out

log = logging.getLogger("fisherlens.worker")


def execute_job(settings: Any, job_id: int, hostname: str | None = None) -> str:
    """Run one job to a final state, or fan it out when its kind's children(spec) > 1.
    Returns what happened (for logs and tests)."""
    from compute.jobs.registry import parse_spec
    from compute.jobs.runners import child_count, get_runner

    worker = hostname or lifecycle.hostname(settings)
    fault_point("after_receive", f"job={job_id}")  # tests only (compute.runtime.control)
    taken = claim(settings, job_id, worker)
    if isinstance(taken, str):
        return taken
    fault_point("after_claim", f"job={job_id}")
    kind = taken.kind
    try:
        with keep_alive(settings, job_id):  # child_count imports the kind's module (torch)
            spec = parse_spec(kind, taken.spec)
            refs = fetch_refs(settings, job_id, taken.refs)  # resolved at submit; sha256 re-verified
            seen = snapshot(refs)  # what each checked entry is now; compared after the run
            n = child_count(kind, spec)
        if n > 1:
            return fan_out(settings, job_id, n)
    except Exception as exc:
        log.exception("job %s failed", job_id)
        fail(settings, job_id, exc)
        return "failed"

    def compute(progress: JobProgress) -> Any:
        progress(0.0, "loading")
        result = get_runner(kind)(spec, progress, refs=refs)
        unchanged(refs, seen)  # a file swapped (and back) while the job read it: nothing stored
        return result

    return compute_and_store(settings, job_id, compute, "running")
