"""Alembic's entry point: run the migrations against the URL in the Alembic config, else the settings'.

Connections come from worker.store.db.make_engine, like the rest of batchwork; this file never defines
tables (target_metadata is worker.store.tables).
"""

from __future__ import annotations

from logging.config import fileConfig

from alembic import context

from worker.settings import get_settings
from worker.store.db import make_engine
from worker.store.tables import metadata

config = context.config
# Only `alembic` run from the command line has an ini file; a programmatic migrate() leaves the
# application's logging alone.
if config.config_file_name is not None:
    fileConfig(config.config_file_name, disable_existing_loggers=False)


def database_url() -> str:
    return config.get_main_option("sqlalchemy.url") or get_settings().database_url


def run_migrations_offline() -> None:
    """Write the SQL to stdout (`alembic upgrade head --sql`) instead of running it."""
    url = database_url()
    context.configure(
        url=url,
        target_metadata=metadata,
        literal_binds=True,
        render_as_batch=url.startswith("sqlite"),
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    engine = make_engine(database_url())
    try:
        with engine.connect() as connection:
            # SQLite cannot ALTER most of a table; batch mode recreates the table instead.
            context.configure(
                connection=connection,
                target_metadata=metadata,
                render_as_batch=connection.dialect.name == "sqlite",
            )
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
