"""jobs.model_revision holds a fixed-length digest; the joined parts move to jobs.revisions

A job's model revision joins one part per referenced model or artifact
(`model=<sha256>;teacher=<sha256>;mask=job:3:<sha256>`), which is longer than the 128-character
column on PostgreSQL (SQLite ignores the length). From this revision on, `model_revision` is the
sha256 hex of the joined parts (always 64 characters; reuse compares it) and the parts themselves
are kept, readable, in the JSON column `revisions`. Existing rows are converted with the same
digest, so a job submitted again after the upgrade still finds its stored result.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

from __future__ import annotations

import hashlib

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

_jobs = sa.table(
    "jobs",
    sa.column("id", sa.Integer()),
    sa.column("model_revision", sa.String(128)),
    sa.column("revisions", sa.JSON()),
)


def _digest(joined: str) -> str:
    # Same function as storage.models.revision_digest (copied: a migration must not change
    # when application code does).
    return hashlib.sha256(joined.encode("utf-8")).hexdigest()


def upgrade() -> None:
    op.add_column("jobs", sa.Column("revisions", sa.JSON(), nullable=True))
    conn = op.get_bind()
    rows = conn.execute(
        sa.select(_jobs.c.id, _jobs.c.model_revision).where(_jobs.c.model_revision.is_not(None))
    ).all()
    for job_id, joined in rows:
        conn.execute(
            _jobs.update()
            .where(_jobs.c.id == job_id)
            .values(model_revision=_digest(joined), revisions=joined.split(";"))
        )


def downgrade() -> None:
    conn = op.get_bind()
    rows = conn.execute(
        sa.select(_jobs.c.id, _jobs.c.revisions).where(_jobs.c.revisions.is_not(None))
    ).all()
    for job_id, parts in rows:
        joined = ";".join(parts or [])
        if len(joined) <= 128:  # longer ones keep their digest (the old column cannot hold them)
            conn.execute(
                _jobs.update().where(_jobs.c.id == job_id).values(model_revision=joined)
            )
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("revisions")
