"""Create generated_tokens: per item of a generation job, its tokens so far.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "generated_tokens",
        sa.Column("job_id", sa.String(length=36), nullable=False),
        sa.Column("item_index", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("tokens", sa.Integer(), nullable=False),
        sa.Column("final", sa.Boolean(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("job_id", "item_index", name=op.f("pk_generated_tokens")),
    )


def downgrade() -> None:
    op.drop_table("generated_tokens")
