"""JSON shapes of stored rows (what the API serves) and the JSON-safe copy every stored value
goes through. No session, no queries."""

from __future__ import annotations

import math
from datetime import datetime
from typing import Any

from storage.models import ArtifactRow, Job, Model


def json_safe(obj: Any) -> Any:
    """JSON-safe copy: NaN/inf -> None (PostgreSQL's json rejects them), tuples -> lists,
    numpy/torch scalars -> Python numbers."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, bool | int | str) or obj is None:
        return obj
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_safe(v) for v in obj]
    if hasattr(obj, "item") and callable(obj.item):
        try:
            return json_safe(obj.item())
        except (ValueError, RuntimeError):
            pass
    if hasattr(obj, "tolist"):
        return json_safe(obj.tolist())
    return str(obj)


def iso(dt: datetime | None) -> str | None:
    return dt.isoformat() if dt is not None else None


def model_dict(m: Model) -> dict[str, Any]:
    return {
        "id": m.id,
        "name": m.name,
        "source": m.source,
        "revision": m.revision,
        "architecture": m.architecture,
        "n_params": m.n_params,
        "n_layers": m.n_layers,
        "info": m.info or {},
        "created_at": iso(m.created_at),
    }


# A job's public fields, in order: job_dict reads them from the ORM row, the listing
# (storage.jobs.list_job_dicts) selects the same columns without the ORM; one list for both
JOB_DICT_COLUMNS = ("id", "kind", "spec", "spec_hash", "model_revision", "revisions", "status",
                    "progress", "message", "error", "share_token", "created_at", "started_at",
                    "finished_at", "heartbeat_at", "worker", "attempts", "cancel_requested",
                    "parent_id", "shard_index", "n_children", "combine_state", "owner_id", "shared",
                    "estimate")
JOB_DATES = frozenset(("created_at", "started_at", "finished_at", "heartbeat_at"))


def job_dict(job: Job) -> dict[str, Any]:
    return {c: iso(getattr(job, c)) if c in JOB_DATES else getattr(job, c) for c in JOB_DICT_COLUMNS}


def artifact_dict(a: ArtifactRow) -> dict[str, Any]:
    return {
        "kind": a.kind,
        "path": a.path,
        "sha256": a.sha256,
        "bytes": a.bytes,
        "is_dir": a.is_dir,
    }
