"""Fixtures giving each integration test its own SQLite file, PostgreSQL schema or Redis database.

Every fixture cleans up after itself. A service that cannot be reached skips the test on a laptop but
fails it under CI (env var CI set), so CI never passes by skipping.
"""

from __future__ import annotations

import os
import random
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError

from tests.integration.tiny_gpt2 import tiny_gpt2, tiny_gpt2_eos  # noqa: F401  (fixtures for every test here)
from worker.store.db import make_engine
from worker.store.results import ResultStore
from worker.store.schema import migrate

POSTGRES_URL = os.environ.get("TEST_POSTGRES_URL", "postgresql+psycopg://root@127.0.0.1:5432/test")
# Host and port only; each test gets a database number of its own.
REDIS_URL = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379").rstrip("/")

# Database 0 holds the claims; tests use 1..15 (Redis has 16 databases unless configured otherwise).
REDIS_TEST_DBS = range(1, 16)
# Longer than pytest's per-test timeout, so a claim left by a killed run frees itself.
REDIS_CLAIM_TTL_S = 900


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'batchwork.db'}"


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A URL whose search_path is a fresh schema, dropped with everything in it afterwards."""
    schema = f"t_{uuid.uuid4().hex[:12]}"
    admin = make_engine(POSTGRES_URL)
    try:
        with admin.begin() as conn:
            conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    except OperationalError as error:
        admin.dispose()
        if os.environ.get("CI"):
            raise
        pytest.skip(f"PostgreSQL unreachable at {POSTGRES_URL}: {error.orig}")
    url = make_url(POSTGRES_URL).update_query_dict({"options": f"-csearch_path={schema}"})
    try:
        yield url.render_as_string(hide_password=False)
    finally:
        with admin.begin() as conn:
            # A test that leaked an open transaction should fail here, not hang the run.
            conn.execute(text("SET LOCAL lock_timeout = '10s'"))
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def empty_db_url(request: pytest.FixtureRequest) -> str:
    """An empty database of each dialect in turn (tests ids "sqlite" and "postgresql")."""
    fixture = {"sqlite": "sqlite_url", "postgresql": "pg_url"}[request.param]
    return request.getfixturevalue(fixture)


@pytest.fixture
def db_url(empty_db_url: str) -> str:
    """A database of each dialect in turn, migrated to head."""
    migrate(empty_db_url)
    return empty_db_url


@pytest.fixture
def pg_store(pg_url: str) -> Iterator[ResultStore]:
    """A store on this test's own PostgreSQL schema, migrated to head."""
    migrate(pg_url)
    store = ResultStore.from_url(pg_url)
    try:
        yield store
    finally:
        store.close()


@pytest.fixture
def redis_url() -> Iterator[str]:
    """A Redis database number of this test's own, empty before and flushed after."""
    claims = redis.Redis.from_url(f"{REDIS_URL}/0")
    try:
        number = _claim_redis_db(claims)
    except redis.ConnectionError as error:
        claims.close()
        if os.environ.get("CI"):
            raise
        pytest.skip(f"Redis unreachable at {REDIS_URL}: {error}")
    url = f"{REDIS_URL}/{number}"
    client = redis.Redis.from_url(url)
    client.flushdb()
    try:
        yield url
    finally:
        client.flushdb()
        client.close()
        claims.delete(_claim_key(number))
        claims.close()


def _claim_key(number: int) -> str:
    return f"batchwork:test-db-claim:{number}"


def _claim_redis_db(claims: redis.Redis) -> int:
    # A claim key (SET NX) rather than a counter: xdist workers and two checkouts testing at once are
    # separate processes, and only Redis itself sees them all.
    for number in random.sample(REDIS_TEST_DBS, len(REDIS_TEST_DBS)):
        if claims.set(_claim_key(number), os.getpid(), nx=True, ex=REDIS_CLAIM_TTL_S):
            return number
    raise RuntimeError(
        f"all Redis test databases {REDIS_TEST_DBS.start}..{REDIS_TEST_DBS.stop - 1} are claimed; "
        f"wait for other test runs, or delete the keys {_claim_key(0)[:-1]}* in database 0"
    )


@pytest.fixture
def store(db_url: str) -> Iterator[ResultStore]:
    store = ResultStore.from_url(db_url)
    yield store
    store.close()


@pytest.fixture
def producer(
    redis_url: str, pg_url: str, pg_store: ResultStore, monkeypatch: pytest.MonkeyPatch
) -> Iterator[dict[str, str]]:
    """This test's process as a producer on the test's Redis and migrated PostgreSQL schema (its settings
    from the environment, read afresh); the env a worker of the same deployment takes."""
    from tests.integration.processes import service_env
    from worker.settings import get_settings

    env = service_env(redis_url, pg_url, simulated_base_ms="300", simulated_per_item_ms="0")
    for name, value in env.items():
        if name.startswith("BATCHWORK_"):
            monkeypatch.setenv(name, value)
    get_settings.cache_clear()
    yield env
    get_settings.cache_clear()
