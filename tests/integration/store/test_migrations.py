"""The migrations build exactly the schema the models declare, on SQLite and PostgreSQL alike."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect

from worker.store import tables
from worker.store.db import make_engine
from worker.store.schema import alembic_config, migrate

REPO_ROOT = Path(__file__).resolve().parents[3]


def schema_diff(url: str) -> list[object]:
    """Alembic autogenerate's differences between the database at ``url`` and the models."""
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(
                conn, opts={"compare_type": True, "compare_server_default": True}
            )
            return compare_metadata(context, tables.metadata)
    finally:
        engine.dispose()


def table_names(url: str) -> set[str]:
    engine = make_engine(url)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_upgrade_to_head_builds_the_models_schema(empty_db_url: str) -> None:
    migrate(empty_db_url)

    assert schema_diff(empty_db_url) == []


def test_downgrade_to_base_and_back_up(empty_db_url: str) -> None:
    migrate(empty_db_url)
    command.downgrade(alembic_config(empty_db_url), "base")
    assert table_names(empty_db_url) == {"alembic_version"}

    migrate(empty_db_url)
    assert schema_diff(empty_db_url) == []


def test_upgrade_again_is_a_no_op(empty_db_url: str) -> None:
    migrate(empty_db_url)
    migrate(empty_db_url)

    assert schema_diff(empty_db_url) == []


def test_alembic_command_line_from_repo_root_uses_settings_url(sqlite_url: str) -> None:
    # What compose's migrate service runs: no URL in alembic.ini, BATCHWORK_DATABASE_URL decides.
    env = {**os.environ, "BATCHWORK_DATABASE_URL": sqlite_url}
    subprocess.run(
        [sys.executable, "-m", "alembic", "upgrade", "head"], cwd=REPO_ROOT, env=env, check=True, timeout=120
    )

    assert table_names(sqlite_url) == {
        "alembic_version",
        "jobs",
        "results",
        "batches",
        "generated_tokens",
        "api_keys",
        "tuned_limits",
        "files",
        "file_chunks",
        "openai_batches",
    }
    assert schema_diff(sqlite_url) == []
