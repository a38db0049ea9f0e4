"""jobs.refs: the job's references, resolved once at submit

Every reference a spec names (model, teacher, base, tuned, fisher, mask, gradient) is resolved at
validation by app.services.refs into a typed Ref (compute.contract.kinds: form, path or artifact
key, sha256, owner); the JSON of {field: Ref} is stored here, and the worker reads it instead of
resolving again (it only re-verifies the sha256). Jobs created before this revision have NULL:
a worker fails such a job with a message asking to re-run it (nothing re-resolves in the worker).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("refs", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("refs")
