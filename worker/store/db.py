"""The one place that opens database connections: an Engine for PostgreSQL or SQLite, set up alike.

It knows URLs, drivers, JSON encoding and connection pragmas; it must never know about jobs or results.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import orjson
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DatabaseError, DBAPIError, InterfaceError, OperationalError, ProgrammingError

from worker.errors import DatabaseUnavailable

# Plain postgresql:// would load psycopg2, which batchwork does not install; psycopg 3 is the driver.
_POSTGRES_DRIVERS = {"postgresql": "postgresql+psycopg", "postgres": "postgresql+psycopg"}

# Run on every new SQLite connection. The producer and several worker threads/processes write the same
# file: WAL lets readers go on while one writes, NORMAL is durable enough under WAL and skips an fsync per
# commit, and busy_timeout makes a writer wait for the lock instead of failing with "database is locked".
_SQLITE_PRAGMAS = ("PRAGMA journal_mode=WAL", "PRAGMA synchronous=NORMAL", "PRAGMA busy_timeout=30000")


def _json_dumps(value: Any) -> str:
    # OPT_SERIALIZE_NUMPY: model outputs are often numpy arrays (float32 embeddings). orjson writes a
    # float32 in its shortest float32 form, so it reads back to the very same float32 value.
    return orjson.dumps(value, option=orjson.OPT_SERIALIZE_NUMPY).decode()


def _json_loads(value: str | bytes | float) -> Any:
    # SQLite gives a JSON column NUMERIC affinity: a bare number such as 0.5 is stored and read back as a
    # REAL or INTEGER, not as JSON text. It already is the decoded value.
    if isinstance(value, int | float):
        return value
    return orjson.loads(value)


# Connections a process keeps open to PostgreSQL, shared by its threads (the API's request threads, a worker's
# store, prepare, watch threads). No overflow: SQLAlchemy closes an overflow connection when it is returned,
# so under 50 pollers the API opened a new connection for about one request in two; a thread now waits its
# turn, which costs less than a connect.
POOL_CONNECTIONS = 10


def make_engine(url: str) -> Engine:
    """An Engine for ``url`` (``postgresql://...`` or ``sqlite:///path``) with pooling and JSON set up."""
    parsed = make_url(url)
    drivername = _POSTGRES_DRIVERS.get(parsed.drivername, parsed.drivername)
    parsed = parsed.set(drivername=drivername)
    is_sqlite = parsed.get_backend_name() == "sqlite"
    connect_args: dict[str, Any] = {"timeout": 30, "check_same_thread": False} if is_sqlite else {}
    pool = {} if is_sqlite else {"pool_size": POOL_CONNECTIONS, "max_overflow": 0}
    engine = create_engine(
        parsed,
        pool_pre_ping=True,
        json_serializer=_json_dumps,
        json_deserializer=_json_loads,
        connect_args=connect_args,
        **pool,
    )
    if is_sqlite:
        event.listen(engine, "connect", _set_sqlite_pragmas)
    return engine


def _set_sqlite_pragmas(dbapi_connection: Any, _connection_record: Any) -> None:
    cursor = dbapi_connection.cursor()
    try:
        for pragma in _SQLITE_PRAGMAS:
            cursor.execute(pragma)
    finally:
        cursor.close()


def single_reads(engine: Engine) -> Engine:
    """The same pool in autocommit: for a read that is one statement, which needs no transaction, it saves
    the BEGIN and ROLLBACK round trips (a status poll then costs the pool's ping and the query)."""
    return engine.execution_options(isolation_level="AUTOCOMMIT")


def is_transient(exc: BaseException) -> bool:
    """True for failures that waiting cures: the database down, a connection dropped, a lock busy, or a
    schema not migrated yet (``batchwork migrate`` cures it). Anything else is the data's fault: it never will
    be."""
    if isinstance(exc, OperationalError | InterfaceError) or is_missing_schema(exc):
        return True
    return isinstance(exc, DBAPIError) and exc.connection_invalidated


def refused_text(exc: BaseException) -> str:
    """One line for a write the database (or its driver) refused: the driver's own first line, without the
    statement and parameters SQLAlchemy appends, which may be megabytes of the data that was refused."""
    inner = getattr(exc, "orig", None) or exc
    lines = str(inner).strip().splitlines()
    return f"{type(inner).__name__}: {lines[0] if lines else ''}"[:500]


def is_missing_schema(exc: BaseException) -> bool:
    """A table or column batchwork needs is not there: the database was never migrated, or not to head."""
    code = getattr(getattr(exc, "orig", None), "sqlstate", None)
    if code in ("42P01", "42703"):  # PostgreSQL: undefined table, undefined column
        return True
    text = str(getattr(exc, "orig", exc))
    return isinstance(exc, OperationalError | ProgrammingError) and (
        "no such table" in text or "no such column" in text or "has no column named" in text
    )


def is_duplicate_key(exc: BaseException) -> bool:
    """A row with this key is stored already (PostgreSQL's unique violation)."""
    return getattr(getattr(exc, "orig", None), "sqlstate", None) == "23505"


def shown_url(url: str) -> str:
    """A database URL as it may appear in a message: without its password."""
    return make_url(url).render_as_string(hide_password=True)


@contextmanager
def client_errors(url: str) -> Iterator[None]:
    """Turn a database failure met by a user's command into one line that says what to do."""
    try:
        yield
    except DBAPIError as exc:
        unavailable = database_unavailable(url, exc)
        if unavailable is None:
            raise
        raise unavailable from exc


def database_unavailable(url: str, exc: DBAPIError) -> DatabaseUnavailable | None:
    """The one line for a database that is away, unusable or not migrated; None for any other failure
    (a bug's, which keeps its traceback)."""
    if is_missing_schema(exc):
        return DatabaseUnavailable(
            f"the database {shown_url(url)} has no batchwork schema (or an old one): run `batchwork migrate`"
        )
    reason = str(exc.orig).strip().splitlines()[0] if exc.orig else type(exc).__name__
    # A SQLite file is never "unreachable": its OperationalErrors are a lock held too long, a read-only
    # file or folder, a schema half made; only a server's are about reaching it.
    if isinstance(exc, OperationalError | InterfaceError) and make_url(url).get_backend_name() != "sqlite":
        return DatabaseUnavailable(f"cannot reach the database {shown_url(url)}: {reason}")
    if isinstance(exc, OperationalError | InterfaceError):
        return DatabaseUnavailable(f"cannot use the database {shown_url(url)}: {reason}")
    if type(exc) is DatabaseError:  # SQLite: the file is not a database (or is damaged)
        return DatabaseUnavailable(f"cannot use the database {shown_url(url)}: {reason}")
    return None
