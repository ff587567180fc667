"""Create jobs, results and batches.

Revision ID: 0001
Revises:
Create Date: 2025-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "jobs",
        sa.Column("id", sa.String(length=36), nullable=False),
        sa.Column("model", sa.String(length=200), nullable=False),
        sa.Column("priority", sa.String(length=16), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("total", sa.Integer(), nullable=False),
        sa.Column("done", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("failed", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_jobs")),
    )
    # No foreign key to jobs: see worker.store.tables.Result.
    op.create_table(
        "results",
        sa.Column("job_id", sa.String(length=36), nullable=False),
        sa.Column("item_index", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("item_id", sa.String(length=200), nullable=True),
        sa.Column("output", sa.JSON(none_as_null=True), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("batch_id", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("job_id", "item_index", name=op.f("pk_results")),
    )
    op.create_table(
        "batches",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("model", sa.String(length=200), nullable=False),
        sa.Column("lane", sa.String(length=64), nullable=False),
        sa.Column("size", sa.Integer(), nullable=False),
        sa.Column("real_tokens", sa.Integer(), nullable=False),
        sa.Column("padded_tokens", sa.Integer(), nullable=False),
        sa.Column("wait_ms", sa.Float(), nullable=False),
        sa.Column("run_ms", sa.Float(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("worker", sa.String(length=200), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_batches")),
    )
    op.create_index("ix_batches_started_at", "batches", ["started_at"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_batches_started_at", table_name="batches")
    op.drop_table("batches")
    op.drop_table("results")
    op.drop_table("jobs")
