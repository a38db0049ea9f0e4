"""Stored results: a job's JobResult as rows (layer stats, heatmaps, series) and artifact
records, and the JSON of GET /api/results/{token} read back from them."""

from __future__ import annotations

import math
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from storage.artifacts import ArtifactInfo, Store
from storage.jobs import must_get
from storage.models import ArtifactRow, HeatmapRow, Job, LayerStatRow, SeriesRow, utcnow
from storage.serialize import artifact_dict, job_dict, json_safe


def save_result(
    *,
    session: Session,
    job_id: int,
    result: Any,
    store: Store | None = None,
    artifacts: list[ArtifactInfo] | None = None,
) -> None:
    """Store a compute.contract.jobresult.JobResult for a job, replacing whatever an earlier delivery of the
    same job stored (idempotent: rows are never duplicated). Tensors go to `store` as safetensors,
    `result.files` are moved under the job's artifact folder; `artifacts` adds prepared ones."""
    job = must_get(session, job_id)
    infos: list[ArtifactInfo] = list(artifacts or [])
    if result.tensors or result.files:
        if store is None:
            raise ValueError("store: an artifact store is needed for results with tensors or files")
        for kind, tensors in result.tensors.items():
            infos.append(store.save_tensors(job.id, kind, tensors,
                                            metadata=getattr(result, "metadata", {}).get(kind)))
        for kind, path in result.files.items():
            infos.append(store.save_folder(job.id, kind, path))
    for table in (LayerStatRow, HeatmapRow, SeriesRow, ArtifactRow):
        session.execute(delete(table).where(table.job_id == job.id))
    job.summary = json_safe(result.summary or {})
    session.add_all(_result_rows(job.id, result))
    first = {info.kind: info for info in reversed(infos)}  # one row per kind: the first given
    session.add_all(
        ArtifactRow(job_id=job.id, kind=i.kind, path=i.path, sha256=i.sha256, bytes=i.bytes,
                    is_dir=i.is_dir, created_at=utcnow())
        for i in first.values()
    )
    session.commit()
    session.expire(job)


def _result_rows(job_id: int, result: Any) -> list[Any]:
    """The layer-stat, heatmap and series rows of a JobResult (positions keep its order)."""
    rows: list[Any] = [
        LayerStatRow(job_id=job_id, position=i, param=s.param, module=s.module, layer=s.layer,
                     group=s.group, values=json_safe(s.values))
        for i, s in enumerate(result.layer_stats)
    ]
    rows += [
        HeatmapRow(job_id=job_id, position=i, name=h.name, x_labels=json_safe(list(h.x_labels)),
                   y_labels=json_safe(list(h.y_labels)), z=json_safe(h.z),
                   meta=json_safe(h.meta or {}))
        for i, h in enumerate(result.heatmaps)
    ]
    for i, p in enumerate(result.series):
        value = float(p.value)
        rows.append(SeriesRow(job_id=job_id, position=i, name=p.name, step=float(p.step),
                              value=value if math.isfinite(value) else None))
    return rows


def get_artifact(*, session: Session, job_id: int, kind: str) -> ArtifactRow | None:
    return session.scalar(
        select(ArtifactRow).where(ArtifactRow.job_id == job_id, ArtifactRow.kind == kind)
    )


def result_dict(*, session: Session, job: Job) -> dict[str, Any]:
    """The JSON of GET /api/results/{token}: job metadata plus every stored result row, in the
    same shape as compute.contract.jobresult.JobResult.to_dict() (so plot builders take either)."""
    job_id = job.id
    stats = session.scalars(
        select(LayerStatRow).where(LayerStatRow.job_id == job_id).order_by(LayerStatRow.position)
    )
    heatmaps = session.scalars(
        select(HeatmapRow).where(HeatmapRow.job_id == job_id).order_by(HeatmapRow.position)
    )
    series = session.scalars(
        select(SeriesRow).where(SeriesRow.job_id == job_id).order_by(SeriesRow.position)
    )
    arts = session.scalars(
        select(ArtifactRow).where(ArtifactRow.job_id == job_id).order_by(ArtifactRow.kind)
    )
    return {
        "job": job_dict(job),
        "kind": job.kind,
        "summary": job.summary or {},
        "layer_stats": [
            {
                "param": s.param,
                "module": s.module,
                "layer": s.layer,
                "values": s.values,
                "group": s.group,
            }
            for s in stats
        ],
        "heatmaps": [
            {
                "name": h.name,
                "x_labels": h.x_labels,
                "y_labels": h.y_labels,
                "z": h.z,
                "meta": h.meta,
            }
            for h in heatmaps
        ],
        "series": [{"name": p.name, "step": p.step, "value": p.value} for p in series],
        "artifacts": [artifact_dict(a) for a in arts],
    }
