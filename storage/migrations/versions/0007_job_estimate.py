"""jobs.estimate: what the job was estimated to take when it was submitted

The calibrated estimate the submitter saw (app.limits.estimate: seconds, by part, and the
predicted peak memory), kept with the job so its result can say what it took against what it was
expected to take, part by part (summary.seconds_parts uses the estimate's part names). Jobs
created before this revision, child jobs and direct CLI runs have NULL: their result shows the
time it took alone.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("estimate", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("estimate")
