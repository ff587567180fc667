"""The HTTP API: jobs gain a tenant and the submitter's metadata; api_keys holds the keys' hashes.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Existing jobs came from Python producers: the server default puts them in the default tenant.
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(
            sa.Column("tenant", sa.String(length=64), server_default=sa.text("'default'"), nullable=False)
        )
        batch.add_column(sa.Column("metadata", sa.JSON(none_as_null=True), nullable=True))
        batch.create_index("ix_jobs_tenant_created_at", ["tenant", "created_at"], unique=False)
    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(length=16), nullable=False),
        sa.Column("key_sha256", sa.String(length=64), nullable=False),
        sa.Column("tenant", sa.String(length=64), nullable=False),
        sa.Column("admin", sa.Boolean(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_keys")),
    )
    op.create_index("ix_api_keys_key_sha256", "api_keys", ["key_sha256"], unique=True)


def downgrade() -> None:
    op.drop_index("ix_api_keys_key_sha256", table_name="api_keys")
    op.drop_table("api_keys")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_index("ix_jobs_tenant_created_at")
        batch.drop_column("metadata")
        batch.drop_column("tenant")
