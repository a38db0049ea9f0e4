"""The Celery worker: the only compute package that imports storage and celery.

Tasks (names fixed in compute/runtime/celery_app.py; messages already in a broker carry them):
  fisherlens.run_job(job_id)        any job kind: run inline, or fan out into child jobs when the
                                    kind's children(spec) > 1 (compute/jobs/runners.py's protocol)
  fisherlens.run_shard(job_id)      one child unit (a child job row): run_child(spec, index)
  fisherlens.finish_shards(job_id)  combine(spec, outputs) of the children into the parent's result

Modules: tasks.py (the thin Celery adapters and worker signals), execute.py (run_job's body),
lifecycle.py (claim, heartbeat, progress, store, fail), sharding.py (fan-out, child, combine),
reconciler.py (BrokerView and the reconcile loop).

Nothing stuck, nothing run twice:
- acks_late + reject_on_worker_lost + prefetch 1 + solo pool (compute/runtime/celery_app);
- every delivery first takes the job with the atomic `repo.claim_job` (compare-and-set), so a
  duplicate or re-sent message is harmless: it finds the job claimed or finished and does nothing;
  the combine of a parent is taken with `repo.request_combine` / `repo.claim_combine`, compare-
  and-sets on jobs.combine_state, so it runs once;
- a heartbeat thread while a job runs; cancel is checked at every progress call and at every
  `compute.runtime.control.cancel_point()` (each sampling step, forward chunk, model load);
- `reconcile()` runs in every worker at start-up and every RECONCILE_INTERVAL_S: jobs of dead
  workers are re-queued once or failed; `queued` jobs whose message is in no queue are re-sent
  (on Redis a message a dead consumer held unacked is restored with kombu's `restore_by_tag`);
  parents whose children all succeeded are combined, and failed when a child did not succeed;
- default worker names are unique per process (`worker-<pid>@<host>`), so two workers on one
  host never take each other for dead.

Run: `fisherlens worker` (or `celery -A compute.worker:celery_app worker --pool solo`).
"""

from __future__ import annotations

from compute.worker.execute import execute_job
from compute.worker.lifecycle import MAX_ATTEMPTS, JobProgress, default_worker_name
from compute.worker.reconciler import BrokerView, reconcile
from compute.worker.sharding import execute_finish, execute_shard
from compute.worker.tasks import (
    celery_app,
    finish_shards_task,
    run_job,
    run_shard_task,
    worker_argv,
)

__all__ = [
    "MAX_ATTEMPTS", "BrokerView", "JobProgress", "celery_app", "default_worker_name",
    "execute_finish", "execute_job", "execute_shard", "finish_shards_task", "reconcile",
    "run_job", "run_shard_task", "worker_argv",
]
