"""Bring a database's schema up to date by running the Alembic migrations in ``migrations/``.

The migrations alone create or change tables; nothing here calls ``metadata.create_all``. Processes that
migrate the same database at once take turns (a file lock beside a SQLite file, an advisory lock on
PostgreSQL), so the second finds the schema made instead of making it again.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import text
from sqlalchemy.engine import make_url

from worker.errors import DatabaseUnavailable

# The Alembic environment: installed as worker.migrations (see pyproject.toml), the migrations/ folder of a
# checkout otherwise (an editable install maps the package there too).
_INSTALLED = Path(__file__).resolve().parents[1] / "migrations"
MIGRATIONS_DIR = (
    _INSTALLED if (_INSTALLED / "env.py").exists() else Path(__file__).resolve().parents[2] / "migrations"
)
# Any fixed number: the key of the PostgreSQL advisory lock every `batchwork migrate` takes.
_PG_MIGRATE_LOCK = 0x62617463


def alembic_config(url: str) -> Config:
    """An Alembic Config for ``url`` that needs no alembic.ini (and so works from any directory)."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    # Config options go through ConfigParser interpolation; a URL may hold '%' (e.g. options=-c...%3D...).
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


def migrate(url: str) -> None:
    """Run ``alembic upgrade head`` against ``url``, one process at a time per database."""
    with migration_lock(url):
        command.upgrade(alembic_config(url), "head")


@contextmanager
def migration_lock(url: str) -> Iterator[None]:
    """Hold the database's migration lock: ``<file>.lock`` beside a SQLite file (flock, released when the
    process ends however it ends), a session advisory lock on PostgreSQL. Re-entrant within a process is not
    needed: callers take it once around check-and-migrate."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        if parsed.database in (None, "", ":memory:"):
            yield
            return
        with _file_lock(Path(f"{parsed.database}.lock"), url):
            yield
        return
    if parsed.get_backend_name() != "postgresql":
        yield
        return
    from worker.store.db import make_engine

    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT pg_advisory_lock(:key)"), {"key": _PG_MIGRATE_LOCK})
            conn.commit()
            try:
                yield
            finally:
                conn.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": _PG_MIGRATE_LOCK})
                conn.commit()
    finally:
        engine.dispose()


@contextmanager
def _file_lock(path: Path, url: str) -> Iterator[None]:
    from worker.store.db import shown_url

    try:
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:
        raise DatabaseUnavailable(
            f"cannot use the database {shown_url(url)}: cannot open its lock file {path}: {exc.strerror}"
        ) from None
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        yield
    finally:
        os.close(descriptor)  # closing releases the lock
