"""users and api_tokens; owners of jobs and models; a share link can be turned off

Adds `users` (argon2 password hashes) and `api_tokens` (sha256 of bearer tokens and browser
sessions), `jobs.owner_id`, `jobs.shared` and `models.owner_id`. Creates the user `local` (an
admin without a password: the embedded single-user mode runs as it) and makes it the owner of
every existing job and model, so an upgraded database keeps working in both modes.

On SQLite the owner columns are added without a foreign-key constraint: SQLite cannot add one to
an existing table without copying it, and copying `jobs` (with foreign keys on) would cascade
deletes into the result tables. PostgreSQL gets real constraints.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30
"""

from __future__ import annotations

from datetime import datetime, timezone

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

LOCAL_USER = "local"


def upgrade() -> None:
    op.create_table(
        "users",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("password_hash", sa.String(255), nullable=True),
        sa.Column("is_admin", sa.Boolean(), nullable=False, server_default=sa.false()),
        sa.Column("disabled", sa.Boolean(), nullable=False, server_default=sa.false()),
        sa.Column("max_active_jobs", sa.Integer(), nullable=True),
        sa.Column("max_job_cost", sa.Float(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("name", name="uq_users_name"),
    )
    op.create_table(
        "api_tokens",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column(
            "user_id", sa.Integer(), sa.ForeignKey("users.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("token_hash", sa.String(64), nullable=False),
        sa.Column("prefix", sa.String(16), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False, server_default="api"),
        sa.Column("label", sa.String(200), nullable=False, server_default=""),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_used_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.UniqueConstraint("token_hash", name="uq_api_tokens_hash"),
    )
    op.create_index("ix_api_tokens_user_id", "api_tokens", ["user_id"])
    op.create_index("ix_api_tokens_prefix", "api_tokens", ["prefix"])

    postgres = op.get_bind().dialect.name == "postgresql"
    for table in ("jobs", "models"):
        op.add_column(table, sa.Column("owner_id", sa.Integer(), nullable=True))
        op.create_index(f"ix_{table}_owner_id", table, ["owner_id"])
        if postgres:
            op.create_foreign_key(f"fk_{table}_owner", table, "users", ["owner_id"], ["id"])
    op.add_column(
        "jobs", sa.Column("shared", sa.Boolean(), nullable=False, server_default=sa.true())
    )

    users = sa.table(
        "users",
        sa.column("id", sa.Integer()),
        sa.column("name", sa.String()),
        sa.column("is_admin", sa.Boolean()),
        sa.column("disabled", sa.Boolean()),
        sa.column("created_at", sa.DateTime(timezone=True)),
    )
    conn = op.get_bind()
    conn.execute(
        users.insert().values(
            name=LOCAL_USER, is_admin=True, disabled=False, created_at=datetime.now(timezone.utc)
        )
    )
    local_id = conn.execute(sa.select(users.c.id).where(users.c.name == LOCAL_USER)).scalar_one()
    for table in ("jobs", "models"):
        t = sa.table(table, sa.column("owner_id", sa.Integer()))
        conn.execute(t.update().where(t.c.owner_id.is_(None)).values(owner_id=local_id))


def downgrade() -> None:
    postgres = op.get_bind().dialect.name == "postgresql"
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("shared")
    for table in ("jobs", "models"):
        if postgres:
            op.drop_constraint(f"fk_{table}_owner", table, type_="foreignkey")
        op.drop_index(f"ix_{table}_owner_id", table_name=table)
        with op.batch_alter_table(table) as batch:
            batch.drop_column("owner_id")
    op.drop_index("ix_api_tokens_prefix", table_name="api_tokens")
    op.drop_index("ix_api_tokens_user_id", table_name="api_tokens")
    op.drop_table("api_tokens")
    op.drop_table("users")
