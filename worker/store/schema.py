"""Bring a database's schema up to date by running the Alembic migrations in ``migrations/``.

The migrations alone create or change tables; nothing here calls ``metadata.create_all``.
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

# The Alembic environment: installed as worker.migrations (see pyproject.toml), the migrations/ folder of a
# checkout otherwise (an editable install maps the package there too).
_INSTALLED = Path(__file__).resolve().parents[1] / "migrations"
MIGRATIONS_DIR = (
    _INSTALLED if (_INSTALLED / "env.py").exists() else Path(__file__).resolve().parents[2] / "migrations"
)


def alembic_config(url: str) -> Config:
    """An Alembic Config for ``url`` that needs no alembic.ini (and so works from any directory)."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    # Config options go through ConfigParser interpolation; a URL may hold '%' (e.g. options=-c...%3D...).
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


def migrate(url: str) -> None:
    """Run ``alembic upgrade head`` against ``url``."""
    command.upgrade(alembic_config(url), "head")
