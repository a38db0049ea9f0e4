"""The Celery app definition, without tasks and without torch: the web process imports this to
send tasks by name; compute/worker/tasks.py imports it and registers the task bodies.

Broker: settings.redis_url when set, else kombu's filesystem transport under settings.queue_dir
(the embedded default), with atomic writes (AtomicFilesystemTransport, URL `fsatomic://`). No
result backend: job status lives in our database.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from time import monotonic
from typing import Any

from celery import Celery
from kombu.transport import TRANSPORT_ALIASES
from kombu.transport import filesystem as _kombu_fs
from kombu.utils.encoding import str_to_bytes
from kombu.utils.json import dumps

RUN_JOB = "fisherlens.run_job"
RUN_SHARD = "fisherlens.run_shard"
FINISH_SHARDS = "fisherlens.finish_shards"


def queue_name(settings: Any) -> str:
    """One queue for all job kinds: Settings.fisherlens_queue (FISHERLENS_QUEUE separates stacks
    sharing one Redis, and tests), read from the settings, never at import."""
    return str(settings.fisherlens_queue)


class _AtomicFilesystemChannel(_kombu_fs.Channel):
    # Ignored for mypy: kombu's filesystem Channel._put names its argument `payload`, the base
    # AbstractChannel._put `message` (kombu calls it positionally); this matches the class it extends
    def _put(self, queue: str, payload: Any, **kwargs: Any) -> None:  # type: ignore[override]
        """Write the message under a temporary name, then rename it into place. kombu writes
        the final file in place, so a consumer listing the folder between open() and write()
        read an empty file, and the worker died with "Unrecoverable error: JSONDecodeError"
        (seen under load). The consumer skips names that do not end in `.<queue>.msg`."""
        name = f"{int(round(monotonic() * 1000))}_{uuid.uuid4()}.{queue}.msg"
        final = os.path.join(self.data_folder_out, name)
        tmp = os.path.join(self.data_folder_out, f".{name}.tmp")
        try:
            with open(tmp, "wb", buffering=0) as f:
                f.write(str_to_bytes(dumps(payload)))
            os.replace(tmp, final)
        except OSError as exc:
            raise _kombu_fs.ChannelError(f"Cannot add file {final!r} to directory") from exc


class AtomicFilesystemTransport(_kombu_fs.Transport):
    """kombu's filesystem transport with atomic message files (see _AtomicFilesystemChannel)."""

    Channel = _AtomicFilesystemChannel


TRANSPORT_ALIASES.setdefault("fsatomic", "compute.runtime.celery_app:AtomicFilesystemTransport")


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
        "task_default_queue": queue_name(settings),
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
        conf["broker_url"] = "fsatomic://"
        conf["broker_transport_options"] = filesystem_options(Path(settings.queue_dir))
        conf["worker_enable_remote_control"] = False
        conf["worker_send_task_events"] = False
    return conf


def make_celery(settings: Any | None = None) -> Celery:
    if settings is None:
        from compute.contract.settings import get_settings

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
    celery_for(settings).send_task(task, args=[int(job_id)], queue=queue_name(settings))
