"""SQLAlchemy 2.x models. Alembic owns the schema (storage/migrations); keep both in step.

Tables: models, jobs, layer_stats, heatmaps, series, artifacts; users, api_tokens, rate_limits;
workers (what each live worker's device offers a job). Result rows hang off a job and are
deleted with it; a re-delivered job replaces its result rows (see repo.save_result).
"""

from __future__ import annotations

import hashlib
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship
from sqlalchemy.types import TypeDecorator

JOB_STATUSES = ("queued", "running", "succeeded", "failed", "cancelled")
FINAL_STATUSES = ("succeeded", "failed", "cancelled")


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


def revision_digest(parts: list[str] | None) -> str | None:
    """jobs.model_revision: the sha256 hex (64 characters, fits every database) of a job's
    revision parts joined with ';' (None when there are none). The parts are kept in
    jobs.revisions. Migration 0002 converts older rows with the same function."""
    if not parts:
        return None
    return hashlib.sha256(";".join(parts).encode("utf-8")).hexdigest()


class UTCDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC datetimes on every backend (SQLite hands back naive ones)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is not None and value.tzinfo is None:
            value = value.replace(tzinfo=timezone.utc)
        return value

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is not None and value.tzinfo is None:
            value = value.replace(tzinfo=timezone.utc)
        return value


class Base(DeclarativeBase):
    pass


class Model(Base):
    """A registered model: zoo name, local HF folder or hub id, with its content revision."""

    __tablename__ = "models"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(500), unique=True)
    source: Mapped[str] = mapped_column(String(1000))  # resolved path or hub id
    revision: Mapped[str | None] = mapped_column(String(128), default=None)
    architecture: Mapped[str | None] = mapped_column(String(200), default=None)
    n_params: Mapped[int | None] = mapped_column(BigInteger, default=None)
    n_layers: Mapped[int | None] = mapped_column(Integer, default=None)
    info: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    # Who registered it (migration 0003). Names stay unique: only admins register them when
    # AUTH_REQUIRED, and an existing name is never re-pointed at another folder.
    owner_id: Mapped[int | None] = mapped_column(ForeignKey("users.id"), default=None, index=True)


class Job(Base):
    __tablename__ = "jobs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    kind: Mapped[str] = mapped_column(String(32), index=True)
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    spec_hash: Mapped[str] = mapped_column(String(64))
    # sha256 of the joined revision parts (revision_digest); the parts are in `revisions`.
    model_revision: Mapped[str | None] = mapped_column(String(128), default=None)
    revisions: Mapped[list[str] | None] = mapped_column(JSON, default=None)
    # {field: Ref as JSON} resolved once at submit (app.services.refs; migration 0005); the
    # worker re-verifies their sha256 and never resolves a reference again.
    refs: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    # the estimate its submitter saw (seconds, seconds_parts, memory_bytes, from app.limits.estimate;
    # migration 0007): the result compares it with what the job took, part by part
    estimate: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    status: Mapped[str] = mapped_column(String(16), default="queued", index=True)
    progress: Mapped[float] = mapped_column(Float, default=0.0)
    message: Mapped[str] = mapped_column(Text, default="")
    error: Mapped[str | None] = mapped_column(Text, default=None)
    summary: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    share_token: Mapped[str] = mapped_column(String(64), unique=True, index=True)
    # Owner (migration 0003; shard children copy their parent's). `shared`: whether the share
    # link opens the result for anyone holding it; the owner can turn it off or rotate the token.
    owner_id: Mapped[int | None] = mapped_column(ForeignKey("users.id"), default=None, index=True)
    shared: Mapped[bool] = mapped_column(Boolean, default=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), default=None)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), default=None)
    heartbeat_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), default=None)
    worker: Mapped[str | None] = mapped_column(String(255), default=None)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    # Child jobs (compute/jobs/runners.py's child protocol) point at their parent; shard_index orders them.
    parent_id: Mapped[int | None] = mapped_column(
        ForeignKey("jobs.id", ondelete="CASCADE"), default=None, index=True
    )
    shard_index: Mapped[int | None] = mapped_column(Integer, default=None)
    # A parent of child jobs (migration 0004; storage/fanout.py): how many it fanned out into, and
    # its combining step: None, 'queued' (the finish message was sent), 'running' (one worker).
    n_children: Mapped[int | None] = mapped_column(Integer, default=None)
    combine_state: Mapped[str | None] = mapped_column(String(16), default=None)

    layer_stats: Mapped[list[LayerStatRow]] = relationship(
        back_populates="job", cascade="all, delete-orphan", order_by="LayerStatRow.position"
    )
    heatmaps: Mapped[list[HeatmapRow]] = relationship(
        back_populates="job", cascade="all, delete-orphan", order_by="HeatmapRow.position"
    )
    series: Mapped[list[SeriesRow]] = relationship(
        back_populates="job", cascade="all, delete-orphan", order_by="SeriesRow.position"
    )
    artifacts: Mapped[list[ArtifactRow]] = relationship(
        back_populates="job", cascade="all, delete-orphan", order_by="ArtifactRow.kind"
    )

    __table_args__ = (Index("ix_jobs_reuse", "kind", "spec_hash", "model_revision"),)


class LayerStatRow(Base):
    __tablename__ = "layer_stats"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    position: Mapped[int] = mapped_column(Integer, default=0)
    param: Mapped[str] = mapped_column(String(500), default="")
    module: Mapped[str] = mapped_column(String(32), default="other")
    layer: Mapped[int | None] = mapped_column(Integer, default=None)
    group: Mapped[str] = mapped_column(String(64), default="tensor")
    values: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)

    job: Mapped[Job] = relationship(back_populates="layer_stats")


class HeatmapRow(Base):
    __tablename__ = "heatmaps"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    position: Mapped[int] = mapped_column(Integer, default=0)
    name: Mapped[str] = mapped_column(String(200))
    x_labels: Mapped[list[str]] = mapped_column(JSON, default=list)
    y_labels: Mapped[list[str]] = mapped_column(JSON, default=list)
    z: Mapped[list[list[float | None]]] = mapped_column(JSON, default=list)
    meta: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)

    job: Mapped[Job] = relationship(back_populates="heatmaps")


class SeriesRow(Base):
    __tablename__ = "series"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    position: Mapped[int] = mapped_column(Integer, default=0)
    name: Mapped[str] = mapped_column(String(200))
    step: Mapped[float] = mapped_column(Float)
    value: Mapped[float | None] = mapped_column(Float, default=None)

    job: Mapped[Job] = relationship(back_populates="series")


class ArtifactRow(Base):
    """A file under the artifact root: path is relative to it (portable across mounts)."""

    __tablename__ = "artifacts"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    kind: Mapped[str] = mapped_column(String(64))
    path: Mapped[str] = mapped_column(String(1000))
    sha256: Mapped[str] = mapped_column(String(64))
    bytes: Mapped[int] = mapped_column(BigInteger)
    is_dir: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)

    job: Mapped[Job] = relationship(back_populates="artifacts")

    __table_args__ = (UniqueConstraint("job_id", "kind", name="uq_artifacts_job_kind"),)


class User(Base):
    """An account (migration 0003). The embedded single-user mode runs as the user `local`."""

    __tablename__ = "users"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    password_hash: Mapped[str | None] = mapped_column(String(255), default=None)  # argon2 (pwdlib)
    is_admin: Mapped[bool] = mapped_column(Boolean, default=False)
    disabled: Mapped[bool] = mapped_column(Boolean, default=False)
    # Per-user limits; None = the settings' default for the user's role.
    max_active_jobs: Mapped[int | None] = mapped_column(Integer, default=None)
    max_job_cost: Mapped[float | None] = mapped_column(Float, default=None)
    # Per-user limit on a job's estimated run time (migration 0006; app/limits.py).
    max_job_seconds: Mapped[float | None] = mapped_column(Float, default=None)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class ApiToken(Base):
    """A bearer token (kind 'api') or a browser session (kind 'session'), stored as the sha256
    of the secret; `prefix` (the first characters of the secret) names it in listings."""

    __tablename__ = "api_tokens"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"), index=True)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    prefix: Mapped[str] = mapped_column(String(16), index=True)
    kind: Mapped[str] = mapped_column(String(16), default="api")
    label: Mapped[str] = mapped_column(String(200), default="")
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), default=None)
    last_used_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), default=None)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), default=None)
    # A session opened by signing in with an API token: that token (migration 0006), so revoking
    # the token ends the session too.
    parent_id: Mapped[int | None] = mapped_column(Integer, default=None, index=True)


class RateLimit(Base):
    """A throttling counter (migration 0006) when no Redis is configured: `count` hits of `key`
    in the window that ends at `expires_at` (seconds since the epoch). app/auth/throttle.py."""

    __tablename__ = "rate_limits"

    key: Mapped[str] = mapped_column(String(255), primary_key=True)
    count: Mapped[int] = mapped_column(Integer, default=0)
    expires_at: Mapped[float] = mapped_column(Float, default=0.0)


class WorkerDevice(Base):
    """What a live worker's device offers a job (migration 0008): written by the worker at start,
    after each job and with its reconcile beat, read by the web's estimate so a job is checked
    against the memory and priced at the speed of the device it will run on, not the web
    process's (which has no GPU in a deployment and never imports torch). compute/worker/device.py
    writes it; storage/workers.py reads and writes it; app/limits.py uses it."""

    __tablename__ = "workers"

    name: Mapped[str] = mapped_column(String(255), primary_key=True)  # the Celery node name
    host: Mapped[str] = mapped_column(String(255), default="")
    device: Mapped[str] = mapped_column(String(32), default="cpu")  # where a job on device=auto runs
    device_name: Mapped[str] = mapped_column(String(255), default="")
    # what a job may take there now (free memory, within MAX_JOB_MEMORY_MB), measured while idle
    free_bytes: Mapped[int | None] = mapped_column(BigInteger, default=None)
    total_bytes: Mapped[int | None] = mapped_column(BigInteger, default=None)
    host_free_bytes: Mapped[int | None] = mapped_column(BigInteger, default=None)  # RAM beside a GPU
    # the cost model measured on that device (compute.lm.calibrate): seconds = passes x (a + b x params)
    seconds_per_token_pass: Mapped[float | None] = mapped_column(Float, default=None)
    seconds_per_param_token_pass: Mapped[float | None] = mapped_column(Float, default=None)
    torch_version: Mapped[str] = mapped_column(String(64), default="")
    seen_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow, index=True)
