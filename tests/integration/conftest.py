"""Fixtures giving each integration test its own SQLite file, PostgreSQL schema or Redis database.

The test session starts its own redis-server and PostgreSQL (tests/support/services.py: free ports on
127.0.0.1, temporary directories, gone with the session); no test talks to a Redis or PostgreSQL it did not
start, so a machine's own servers and their data are never touched. Each pytest process (each xdist worker)
has its own pair. Every fixture cleans up after itself. A server that cannot be started (a binary missing)
skips the tests that need it on a laptop but fails them under CI (env var CI set), so CI never passes by
skipping.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TypeVar

import pytest
import redis
from sqlalchemy import text
from sqlalchemy.engine import make_url

from tests.integration.tiny_gpt2 import tiny_gpt2, tiny_gpt2_eos  # noqa: F401  (fixtures for every test here)
from tests.support.services import PostgresServer, RedisServer, ServiceUnavailable
from worker.store.db import make_engine
from worker.store.results import ResultStore
from worker.store.schema import migrate

# The session's Redis: tests take databases 1..15 (one at a time per process: tests in a process run in turn).
REDIS_TEST_DBS = range(1, 16)

Server = TypeVar("Server", RedisServer, PostgresServer)


def _unavailable(error: ServiceUnavailable) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"{error} (CI is set: no integration test may skip)", pytrace=False)
    pytest.skip(str(error))


def _started(server_class: type[Server]) -> Iterator[Server]:
    """The server, started for the session; skipped (failed under CI) where it cannot start."""
    try:
        server = server_class()
    except ServiceUnavailable as error:
        _unavailable(error)
        raise
    with server:
        yield server


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """The session's own redis-server."""
    yield from _started(RedisServer)


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """The session's own PostgreSQL (database ``test``, superuser ``batchwork``, no password)."""
    yield from _started(PostgresServer)


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'batchwork.db'}"


@pytest.fixture
def pg_url(postgres_server: PostgresServer) -> Iterator[str]:
    """A URL whose search_path is a fresh schema, dropped with everything in it afterwards."""
    schema = f"t_{uuid.uuid4().hex[:12]}"
    admin = make_engine(postgres_server.url)
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    url = make_url(postgres_server.url).update_query_dict({"options": f"-csearch_path={schema}"})
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


_free_redis_dbs = list(REDIS_TEST_DBS)


@pytest.fixture
def redis_url(redis_server: RedisServer) -> Iterator[str]:
    """A database number of the session's Redis for this test alone, empty before and flushed after."""
    number = _free_redis_dbs.pop(0)
    url = f"{redis_server.url}/{number}"
    client = redis.Redis.from_url(url)
    client.flushdb()
    try:
        yield url
    finally:
        client.flushdb()
        client.close()
        _free_redis_dbs.append(number)


@pytest.fixture
def own_redis_url() -> Iterator[str]:
    """Database 0 of a redis-server started for this test alone: for tests that count the server's
    commands (INFO commandstats is server-wide), so they count only their own."""
    try:
        server = RedisServer()
    except ServiceUnavailable as error:
        _unavailable(error)
        raise
    with server:
        yield f"{server.url}/0"


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
