"""What the CLI, the REST API and the UI do with jobs: submit, reuse, cancel, rerun, look up.

No torch here (the web process imports this). Tasks are sent by name with only the job id.
Every function takes `settings` (compute.contract.settings.Settings) and returns plain dicts.

Modules: ``common`` (the session factory, the public form of a job), ``validation`` (what a spec
alone cannot say: model and artifact references, layer ranges, jsonl tasks), ``compat``
(safetensors headers: does a Fisher/mask fit the model, do two checkpoints match), ``jobs``
(submit, list, cancel, rerun, sharing), ``results`` (stored results and artifact downloads) and
``workers`` (what the live workers' devices offer a job).
"""

from app.services.common import (
    REQUEST_BASE,
    base_url,
    public_message,
    sessions,
    share_url,
    without_error,
)
from app.services.jobs import (
    cancel,
    get_job,
    health,
    list_jobs,
    list_models,
    rerun,
    set_sharing,
    submit,
    trained_models,
)
from app.services.results import artifact_path, artifact_url, result_by_id, result_by_token
from app.services.validation import check_spec, validate
from app.services.workers import workers

__all__ = [
    "artifact_path",
    "artifact_url",
    "cancel",
    "check_spec",
    "get_job",
    "health",
    "list_jobs",
    "list_models",
    "public_message",
    "rerun",
    "result_by_id",
    "result_by_token",
    "sessions",
    "set_sharing",
    "share_url",
    "REQUEST_BASE",
    "base_url",
    "submit",
    "trained_models",
    "validate",
    "without_error",
    "workers",
]
