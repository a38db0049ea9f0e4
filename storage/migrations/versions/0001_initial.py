"""initial schema: models, jobs, layer_stats, heatmaps, series, artifacts

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    # One create_table per table of the first schema: long by nature, one statement each.
    op.create_table(
        "models",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("name", sa.String(500), nullable=False, unique=True),
        sa.Column("source", sa.String(1000), nullable=False),
        sa.Column("revision", sa.String(128), nullable=True),
        sa.Column("architecture", sa.String(200), nullable=True),
        sa.Column("n_params", sa.BigInteger(), nullable=True),
        sa.Column("n_layers", sa.Integer(), nullable=True),
        sa.Column("info", sa.JSON(), nullable=False),
        sa.Column("created_at", TS, nullable=False),
    )
    op.create_table(
        "jobs",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("spec_hash", sa.String(64), nullable=False),
        sa.Column("model_revision", sa.String(128), nullable=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("progress", sa.Float(), nullable=False),
        sa.Column("message", sa.Text(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("summary", sa.JSON(), nullable=True),
        sa.Column("share_token", sa.String(64), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("started_at", TS, nullable=True),
        sa.Column("finished_at", TS, nullable=True),
        sa.Column("heartbeat_at", TS, nullable=True),
        sa.Column("worker", sa.String(255), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("cancel_requested", sa.Boolean(), nullable=False),
        sa.Column(
            "parent_id", sa.Integer(), sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=True
        ),
        sa.Column("shard_index", sa.Integer(), nullable=True),
    )
    op.create_index("ix_jobs_kind", "jobs", ["kind"])
    op.create_index("ix_jobs_status", "jobs", ["status"])
    op.create_index("ix_jobs_parent_id", "jobs", ["parent_id"])
    op.create_index("ix_jobs_share_token", "jobs", ["share_token"], unique=True)
    op.create_index("ix_jobs_reuse", "jobs", ["kind", "spec_hash", "model_revision"])

    def child(name: str, *cols: sa.Column | sa.UniqueConstraint) -> None:
        op.create_table(
            name,
            sa.Column("id", sa.Integer(), primary_key=True),
            sa.Column(
                "job_id",
                sa.Integer(),
                sa.ForeignKey("jobs.id", ondelete="CASCADE"),
                nullable=False,
            ),
            *cols,
        )
        op.create_index(f"ix_{name}_job_id", name, ["job_id"])

    child(
        "layer_stats",
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("param", sa.String(500), nullable=False),
        sa.Column("module", sa.String(32), nullable=False),
        sa.Column("layer", sa.Integer(), nullable=True),
        sa.Column("group", sa.String(64), nullable=False),
        sa.Column("values", sa.JSON(), nullable=False),
    )
    child(
        "heatmaps",
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("x_labels", sa.JSON(), nullable=False),
        sa.Column("y_labels", sa.JSON(), nullable=False),
        sa.Column("z", sa.JSON(), nullable=False),
        sa.Column("meta", sa.JSON(), nullable=False),
    )
    child(
        "series",
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("step", sa.Float(), nullable=False),
        sa.Column("value", sa.Float(), nullable=True),
    )
    child(
        "artifacts",
        sa.Column("kind", sa.String(64), nullable=False),
        sa.Column("path", sa.String(1000), nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("is_dir", sa.Boolean(), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.UniqueConstraint("job_id", "kind", name="uq_artifacts_job_kind"),
    )


def downgrade() -> None:
    for name in ("artifacts", "series", "heatmaps", "layer_stats", "jobs", "models"):
        op.drop_table(name)
