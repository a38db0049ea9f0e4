"""The Celery app definition, without tasks and without torch: the web process imports this to
send tasks by name; compute/worker.py imports it and registers the task bodies.

Broker: settings.redis_url when set, else kombu's filesystem:// transport under
settings.queue_dir (the embedded default). No result backend: job status lives in our database.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from celery import Celery

RUN_JOB = "fisherlens.run_job"
RUN_SHARD = "fisherlens.run_shard"
FINISH_SHARDS = "fisherlens.finish_shards"
# One queue for all job kinds; FISHERLENS_QUEUE separates stacks sharing one Redis (and tests).
QUEUE = os.environ.get("FISHERLENS_QUEUE", "fisherlens")


def filesystem_options(queue_dir: Path) -> dict[str, Any]:
    """kombu filesystem transport options: one shared message folder (producers write where
    consumers read), processed messages kept for debugging."""
    messages = queue_dir / "messages"
    processed = queue_dir / "processed"
    control = queue_dir / "control"
    for d in (messages, processed, control):
        d.mkdir(parents=True, exist_ok=True)
    return {
        "data_folder_in": str(messages),
        "data_folder_out": str(messages),
        "processed_folder": str(processed),
        "control_folder": str(control),
        "store_processed": False,
        "polling_interval": 0.5,
    }


def celery_config(settings: Any) -> dict[str, Any]:
    conf: dict[str, Any] = {
        "task_serializer": "json",
        "accept_content": ["json"],
        "task_default_queue": QUEUE,
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "task_acks_on_failure_or_timeout": True,
        "worker_prefetch_multiplier": 1,
        "worker_concurrency": 1,
        "worker_pool": "solo",
        "worker_hijack_root_logger": False,
        "broker_connection_retry_on_startup": True,
        "task_ignore_result": True,
        "result_backend": None,
        "worker_send_task_events": True,  # flower
    }
    if settings.redis_url:
        conf["broker_url"] = settings.redis_url
        conf["broker_transport_options"] = {
            "visibility_timeout": int(settings.job_visibility_timeout_s),
        }
    else:
        conf["broker_url"] = "filesystem://"
        conf["broker_transport_options"] = filesystem_options(Path(settings.queue_dir))
        conf["worker_enable_remote_control"] = False
        conf["worker_send_task_events"] = False
    return conf


def make_celery(settings: Any | None = None) -> Celery:
    if settings is None:
        from app.settings import get_settings

        settings = get_settings()
    app = Celery("fisherlens", set_as_current=False)
    app.conf.update(celery_config(settings))
    return app


_apps: dict[tuple[str | None, str], Celery] = {}


def celery_for(settings: Any) -> Celery:
    """One Celery app per broker in this process (for senders: CLI, web, services)."""
    key = (settings.redis_url, str(settings.queue_dir))
    if key not in _apps:
        _apps[key] = make_celery(settings)
    return _apps[key]


def send_job(settings: Any, job_id: int, task: str = RUN_JOB) -> None:
    """Queue `task` for a job id (by name: the sender never imports the task code)."""
    celery_for(settings).send_task(task, args=[int(job_id)], queue=QUEUE)
