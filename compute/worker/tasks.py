"""The Celery tasks: thin adapters (take a job id, call the worker code with fresh settings).
Task names are fixed (compute/runtime/celery_app.py): messages already in a broker carry them."""

from __future__ import annotations

from typing import Any

from celery import signals

import compute.runtime.celery_app as ca
from compute.contract.settings import get_settings
from compute.runtime.celery_app import FINISH_SHARDS, RUN_JOB, RUN_SHARD, make_celery
from compute.worker import reconciler as rec
from compute.worker.execute import execute_job
from compute.worker.lifecycle import hostname as default_hostname
from compute.worker.sharding import execute_finish, execute_shard
from storage.db import upgrade

celery_app = make_celery(get_settings())


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
    name = getattr(sender, "hostname", None) or default_hostname()
    settings = get_settings()
    try:
        rec.reconcile(settings, hostname=name)
    except Exception:
        rec.log.exception("start-up reconcile failed")
    rec.start_reconciler(settings)


@signals.worker_shutdown.connect
def _on_worker_shutdown(**_: Any) -> None:
    rec.stop_reconciler()


def worker_argv(name: str | None = None, loglevel: str = "INFO", settings: Any | None = None) -> list[str]:
    """argv for celery_app.worker_main: one solo worker (one per GPU), our queue only."""
    queue = ca.queue_name(settings or get_settings())
    argv = ["worker", "--pool=solo", "--concurrency=1", "-Q", queue, f"--loglevel={loglevel}"]
    argv += ["--without-mingle", "--without-gossip"]
    argv += ["-n", name or default_hostname()]
    return argv
