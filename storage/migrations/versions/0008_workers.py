"""workers: what each live worker's device offers a job

A worker writes its device (where a job on device=auto runs), the memory a job may take there,
and the cost model measured on it (storage.models.WorkerDevice), so the web's estimate checks a
job against the device it will run on and prices it at that device's speed: the web process has
no GPU in a deployment and never imports torch, and had compared every job with its own RAM.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "workers",
        sa.Column("name", sa.String(255), primary_key=True),
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("device", sa.String(32), nullable=False),
        sa.Column("device_name", sa.String(255), nullable=False),
        sa.Column("free_bytes", sa.BigInteger(), nullable=True),
        sa.Column("total_bytes", sa.BigInteger(), nullable=True),
        sa.Column("host_free_bytes", sa.BigInteger(), nullable=True),
        sa.Column("seconds_per_token_pass", sa.Float(), nullable=True),
        sa.Column("seconds_per_param_token_pass", sa.Float(), nullable=True),
        sa.Column("torch_version", sa.String(64), nullable=False),
        sa.Column("seen_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_workers_seen_at", "workers", ["seen_at"])


def downgrade() -> None:
    op.drop_index("ix_workers_seen_at", table_name="workers")
    op.drop_table("workers")
