"""The OpenAI batches' output written while the jobs run, and files that expire: openai_batches.written (the
writer's cursor) and output_expires_s, files.expires_at.

Revision ID: 0006
Revises: 0005
Create Date: 2027-01-21
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
# Other migrations may be written beside this one; whoever merges second re-chains this to follow them.
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("openai_batches", sa.Column("written", sa.JSON(none_as_null=True), nullable=True))
    op.add_column("openai_batches", sa.Column("output_expires_s", sa.Integer(), nullable=True))
    op.add_column("files", sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("files") as files:
        files.drop_column("expires_at")
    with op.batch_alter_table("openai_batches") as batches:
        batches.drop_column("output_expires_s")
        batches.drop_column("written")
