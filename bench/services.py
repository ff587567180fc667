"""A Redis database and a PostgreSQL schema of a bench run's own, claimed, emptied and given back; a SQLite
file removed whole.

With no URL given, the bench starts a redis-server / PostgreSQL of its own (tests/support/services.py: free
port, temporary directory, gone with the bench), so it touches no server's data. On a server given by URL,
the Redis database is claimed with a key in database 0, so two runs never share one. Nothing here starts
workers or reads batchwork settings.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import make_url

from tests.support.services import PostgresServer, RedisServer

CLAIM_KEY = "batchwork:bench-db-claim:{}"
CLAIM_TTL_S = 1800


@contextmanager
def redis_database(base_url: str | None, wanted: int, owner: str) -> Iterator[tuple[redis.Redis, str]]:
    """An empty Redis database (``wanted`` if free, else another of 1..15): its client and URL. With no
    ``base_url``, on a redis-server started for this run."""
    if not base_url:
        with RedisServer() as server, redis_database(server.url, wanted, owner) as found:
            yield found
        return
    base = base_url.rstrip("/")
    claims = redis.Redis.from_url(f"{base}/0")
    number = next(
        (
            n
            for n in [wanted, *range(15, 0, -1)]
            if claims.set(CLAIM_KEY.format(n), f"{owner} {os.getpid()}", nx=True, ex=CLAIM_TTL_S)
        ),
        None,
    )
    if number is None:
        raise RuntimeError("every Redis database 1..15 is claimed by a test or bench run; try again later")
    url = f"{base}/{number}"
    client = redis.Redis.from_url(url)
    client.flushdb()
    try:
        yield client, url
    finally:
        client.flushdb()
        client.close()
        claims.delete(CLAIM_KEY.format(number))
        claims.close()


@contextmanager
def postgres_schema(postgres_url: str | None, prefix: str) -> Iterator[tuple[Engine, str, str]]:
    """A fresh schema, dropped with everything in it afterwards: an admin engine, its name, and a URL
    whose search_path is that schema. With no ``postgres_url``, on a PostgreSQL started for this run."""
    if not postgres_url:
        with PostgresServer() as server, postgres_schema(server.url, prefix) as found:
            yield found
        return
    schema = f"{prefix}_{uuid.uuid4().hex[:10]}"
    admin = create_engine(postgres_url)
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    url = make_url(postgres_url).update_query_dict({"options": f"-csearch_path={schema}"})
    try:
        yield admin, schema, url.render_as_string(hide_password=False)
    finally:
        with admin.begin() as conn:
            conn.execute(text("SET LOCAL lock_timeout = '10s'"))
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


def remove_sqlite(path: Path) -> None:
    """The database file and its -wal and -shm: a new database beside an old -wal is "disk I/O error"."""
    for part in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        part.unlink(missing_ok=True)
