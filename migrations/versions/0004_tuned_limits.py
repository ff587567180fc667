"""Create tuned_limits: batching limits per model and device kind from `batchwork tune --apply`.

Revision ID: 0004
Revises: 0003
Create Date: 2027-01-10
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
# 0003 is being written beside this one; whoever merges second re-chains this to follow it.
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "tuned_limits",
        sa.Column("model", sa.String(length=200), nullable=False),
        sa.Column("device_kind", sa.String(length=200), nullable=False),
        sa.Column("batching", sa.JSON(none_as_null=True), nullable=True),
        sa.Column("detail", sa.JSON(none_as_null=True), nullable=True),
        sa.Column("tuned_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("tuned_by", sa.String(length=200), nullable=True),
        sa.Column("oom_batch_size", sa.Integer(), nullable=True),
        sa.Column("oom_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("oom_worker", sa.String(length=200), nullable=True),
        sa.PrimaryKeyConstraint("model", "device_kind", name=op.f("pk_tuned_limits")),
    )


def downgrade() -> None:
    op.drop_table("tuned_limits")
