"""The Celery tasks: thin adapters (take a job id, call the worker code with fresh settings).
Task names are fixed (compute/runtime/celery_app.py): messages already in a broker carry them."""

from __future__ import annotations

import threading
from typing import Any

from celery import signals

import compute.runtime.celery_app as ca
from compute.contract.settings import get_settings
from compute.runtime.celery_app import FINISH_SHARDS, RUN_JOB, RUN_SHARD, make_celery
from compute.worker import device as worker_device
from compute.worker import reconciler as rec
from compute.worker.execute import execute_job
from compute.worker.lifecycle import hostname as default_hostname
from compute.worker.sharding import execute_finish, execute_shard
from storage.db import upgrade

celery_app = make_celery(get_settings())


@celery_app.task(name=RUN_JOB, bind=True, acks_late=True, reject_on_worker_lost=True)
def run_job(self: Any, job_id: int) -> str:
    try:
        return execute_job(get_settings(), int(job_id), hostname=self.request.hostname)
    finally:  # idle again: what the next job finds on the device
        worker_device.publish(get_settings(), self.request.hostname or default_hostname())


@celery_app.task(name=RUN_SHARD, bind=True, acks_late=True, reject_on_worker_lost=True)
def run_shard_task(self: Any, job_id: int) -> str:
    try:
        return execute_shard(get_settings(), int(job_id), hostname=self.request.hostname)
    finally:  # idle again: what the next job finds on the device
        worker_device.publish(get_settings(), self.request.hostname or default_hostname())


@celery_app.task(name=FINISH_SHARDS, bind=True, acks_late=True, reject_on_worker_lost=True)
def finish_shards_task(self: Any, job_id: int) -> str:
    try:
        return execute_finish(get_settings(), int(job_id), hostname=self.request.hostname)
    finally:  # idle again: what the next job finds on the device
        worker_device.publish(get_settings(), self.request.hostname or default_hostname())


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
    worker_device.ensure_calibration(settings)  # its device prices its jobs (CALIBRATE_ON_UP)
    # what this worker's device offers a job (the web reads it), written beside the start-up
    # rather than before "ready" (its first torch import took 2-4 s of each worker's start)
    threading.Thread(target=worker_device.publish, args=(settings, name), name="fisherlens-device",
                     daemon=True).start()
    _name[0] = name
    rec.start_reconciler(settings, beat=lambda: worker_device.touch(settings, name))


_name: list[str | None] = [None]  # this worker's node name once it is ready


@signals.worker_shutdown.connect
def _on_worker_shutdown(**_: Any) -> None:
    rec.stop_reconciler()
    if _name[0] is not None:
        worker_device.remove(get_settings(), _name[0])


def worker_argv(name: str | None = None, loglevel: str = "INFO", settings: Any | None = None) -> list[str]:
    """argv for celery_app.worker_main: one solo worker (one per GPU), our queue only."""
    queue = ca.queue_name(settings or get_settings())
    argv = ["worker", "--pool=solo", "--concurrency=1", "-Q", queue, f"--loglevel={loglevel}"]
    argv += ["--without-mingle", "--without-gossip"]
    argv += ["-n", name or default_hostname()]
    return argv
