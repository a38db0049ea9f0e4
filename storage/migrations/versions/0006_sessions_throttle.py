"""api_tokens.parent_id, users.max_job_seconds, and the rate_limits table

* `api_tokens.parent_id`: the API token a browser session was opened with (signing in with a
  token as the password), so revoking the token ends the sessions it opened.
* `users.max_job_seconds`: a per-user limit on a job's estimated run time (app/limits.py turns
  it into a cost ceiling with the throughput measured on the machine).
* `rate_limits`: the counters of sign-in / bad-token throttling (app/auth/throttle.py) when no
  Redis is configured: one row per (limit, key), the count and when its window ends (seconds
  since the epoch), so every web process sees the same counts.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("api_tokens", sa.Column("parent_id", sa.Integer(), nullable=True))
    op.create_index("ix_api_tokens_parent_id", "api_tokens", ["parent_id"])
    op.add_column("users", sa.Column("max_job_seconds", sa.Float(), nullable=True))
    op.create_table(
        "rate_limits",
        sa.Column("key", sa.String(255), primary_key=True),
        sa.Column("count", sa.Integer(), nullable=False),
        sa.Column("expires_at", sa.Float(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("rate_limits")
    with op.batch_alter_table("users") as batch:
        batch.drop_column("max_job_seconds")
    op.drop_index("ix_api_tokens_parent_id", table_name="api_tokens")
    with op.batch_alter_table("api_tokens") as batch:
        batch.drop_column("parent_id")
