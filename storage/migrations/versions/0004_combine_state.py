"""jobs.n_children and jobs.combine_state: the fan-out of a parent job as real columns

A job whose kind splits into child units (compute/jobs/runners.py) records how many children it
fanned out into (`n_children`) and where its combining step stands (`combine_state`):
NULL (children still running, or not a parent), 'queued' (the finish message was sent: exactly
one caller won repo.request_combine), 'running' (one worker holds the combine:
repo.claim_combine). Before this revision the combine was claimed through `worker` and the
display message "combining shards", so a second finish message could be queued.

Existing parents are converted: n_children = their number of child rows; a parent that is
`running` with a worker after its fan-out was combining, so it gets 'running'.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("n_children", sa.Integer(), nullable=True))
    op.add_column("jobs", sa.Column("combine_state", sa.String(16), nullable=True))
    jobs = sa.table(
        "jobs",
        sa.column("id", sa.Integer()),
        sa.column("parent_id", sa.Integer()),
        sa.column("status", sa.String()),
        sa.column("worker", sa.String()),
        sa.column("n_children", sa.Integer()),
        sa.column("combine_state", sa.String()),
    )
    child = jobs.alias("child")
    count = (
        sa.select(sa.func.count())
        .select_from(child)
        .where(child.c.parent_id == jobs.c.id)
        .scalar_subquery()
    )
    has_children = sa.exists().where(child.c.parent_id == jobs.c.id)
    conn = op.get_bind()
    conn.execute(jobs.update().where(has_children).values(n_children=count))
    conn.execute(
        jobs.update()
        .where(has_children, jobs.c.status == "running", jobs.c.worker.is_not(None))
        .values(combine_state="running")
    )


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("combine_state")
        batch.drop_column("n_children")
