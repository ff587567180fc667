"""Bulk INSERT ... ON CONFLICT of job, result and generated-token rows, in the fastest shape each dialect has.

It knows tables and dialects, not job states nor the store's API, and never commits: the caller's
transaction does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

from sqlalchemy import JSON, Connection, Insert, Integer, Row, bindparam, func, literal_column, select
from sqlalchemy.dialects import postgresql, sqlite

from worker.store import tables
from worker.store.tables import UtcDateTime

SUPPORTED_DIALECTS = ("postgresql", "sqlite")

# The result columns that differ per item: the keys of each item row given to insert_results.
ITEM_FIELDS = ("job_id", "item_index", "item_id", "output", "error")

# (job_id, error) of each row actually inserted; rows already there (redelivered items) are left out.
Inserted = Sequence[Row[str, str | None]]

_RESULT_KEY = ["job_id", "item_index"]


def check_dialect(name: str) -> None:
    if name not in SUPPORTED_DIALECTS:
        raise ValueError(f"batchwork stores results in PostgreSQL or SQLite, not {name!r}")


def insert_jobs(conn: Connection, rows: list[dict[str, Any]]) -> set[str]:
    """Insert the job rows that do not exist yet and return their ids; existing jobs are left untouched.
    Every row has the same keys."""
    if not rows:
        return set()
    if conn.dialect.name == "postgresql" and len(rows) > 1:
        # A batch of single-item calls brings a new job per item: one statement for all, as for results.
        statement = _postgresql_jobs_statement(tuple(rows[0]))
        return set(conn.scalars(statement, {"rows": rows}))
    return set(conn.scalars(_JOB_INSERTS[conn.dialect.name], rows))


def insert_results(
    conn: Connection, items: list[dict[str, Any]], batch_id: int | None, created_at: datetime
) -> Inserted:
    """Insert the result rows not stored yet (``items`` keyed by ITEM_FIELDS) and return the new ones."""
    if not items:
        return []
    return _RESULT_INSERTS[conn.dialect.name](conn, items, batch_id, created_at)


def upsert_generated_tokens(conn: Connection, rows: list[dict[str, Any]]) -> None:
    """Insert or update token counts (keys job_id, item_index, tokens, final, updated_at); a final count
    is never changed again, so a late report of the item's run, or a rerun of a redelivered item, cannot
    move it (results are first-writer-wins too)."""
    if rows:
        conn.execute(_TOKEN_UPSERTS[conn.dialect.name], rows)


def _token_upsert(dialect: Any) -> Insert:
    table = tables.generated_tokens
    stmt = dialect.insert(table)
    return stmt.on_conflict_do_update(
        index_elements=_RESULT_KEY,
        set_={name: stmt.excluded[name] for name in ("tokens", "final", "updated_at")},
        where=~table.c.final,
    )


@lru_cache(maxsize=8)
def _postgresql_jobs_statement(fields: tuple[str, ...]) -> Insert:
    given = (
        func.json_populate_recordset(
            literal_column(f"NULL::{tables.jobs.name}"), bindparam("rows", type_=JSON())
        )
        .table_valued(*fields)
        .alias("job")
    )
    return (
        postgresql.insert(tables.jobs)
        .from_select(list(fields), select(*(given.c[name] for name in fields)))
        .on_conflict_do_nothing(index_elements=["id"])
        .returning(tables.jobs.c.id)
    )


def _postgresql_results_statement(quoted_output: bool = False) -> Insert:
    # The whole batch travels as one JSON array that json_populate_recordset turns into result rows:
    # one short statement psycopg parses once, one parameter orjson writes in one call. A multi-row
    # VALUES (7 parameters a row) measured 11k rows/s here, mostly psycopg re-parsing a long query it
    # will not cache; unnest() over five arrays 50k; this 100k (tiny outputs, 1024-row batches).
    # A JSON null becomes SQL NULL, and a json (not jsonb) value keeps its text, float digits included.
    items = (
        func.json_populate_recordset(
            literal_column(f"NULL::{tables.results.name}"), bindparam("items", type_=JSON())
        )
        .table_valued(*ITEM_FIELDS)
        .alias("item")
    )
    # quoted_output: each output arrives as its own JSON text inside a JSON string, unquoted here into the
    # json column (see _insert_results_postgresql).
    columns: list[Any] = [items.c[name] for name in ITEM_FIELDS]
    if quoted_output:
        unquoted = items.c.output.op("#>>")(literal_column("'{}'"))
        columns[ITEM_FIELDS.index("output")] = func.cast(unquoted, JSON)
    rows = select(
        *columns,
        bindparam("batch_id", type_=Integer()),
        bindparam("created_at", type_=UtcDateTime()),
    )
    column = tables.results.c
    return (
        postgresql.insert(tables.results)
        .from_select([*ITEM_FIELDS, "batch_id", "created_at"], rows)
        .on_conflict_do_nothing(index_elements=_RESULT_KEY)
        .returning(column.job_id, column.error)
    )


def _insert_results_postgresql(
    conn: Connection, items: list[dict[str, Any]], batch_id: int | None, created_at: datetime
) -> Inserted:
    # PostgreSQL parses the whole array to populate the records and refuses a \u0000 escape on the way
    # (it can turn none into text), though a json column keeps it: a generated text may hold U+0000. The
    # rare rows whose output holds one send that output's JSON text as a JSON string instead, unquoted
    # into the column by a second statement, so the escape stays six characters until it is read back.
    with_nul = [item for item in items if _holds_nul(item["output"])]
    if not with_nul:
        params = {"items": items, "batch_id": batch_id, "created_at": created_at}
        return conn.execute(_POSTGRESQL_RESULTS, params).all()
    plain = [item for item in items if not _holds_nul(item["output"])]
    quoted = [{**item, "output": _json_text(item["output"])} for item in with_nul]
    inserted = (
        list(conn.execute(_POSTGRESQL_RESULTS, _params(plain, batch_id, created_at)).all()) if plain else []
    )
    return inserted + list(
        conn.execute(_POSTGRESQL_QUOTED_RESULTS, _params(quoted, batch_id, created_at)).all()
    )


def _params(items: list[dict[str, Any]], batch_id: int | None, created_at: datetime) -> dict[str, Any]:
    return {"items": items, "batch_id": batch_id, "created_at": created_at}


def _holds_nul(value: Any) -> bool:
    """Whether a JSON-able output holds U+0000 in any string (keys included); arrays of numbers are skipped
    at the cost of one look at their type."""
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any(_holds_nul(key) or _holds_nul(item) for key, item in value.items())
    if isinstance(value, list | tuple):
        return any(_holds_nul(item) for item in value if not isinstance(item, int | float))
    return False


def _json_text(value: Any) -> str:
    from worker.store.db import _json_dumps

    return _json_dumps(value)


def _insert_results_sqlite(
    conn: Connection, items: list[dict[str, Any]], batch_id: int | None, created_at: datetime
) -> Inserted:
    # An executemany that SQLAlchemy's insertmanyvalues sends as multi-row INSERTs, each within SQLite's
    # bound-parameter limit. RETURNING gives the error itself, not `error IS NOT NULL`: SQLite 3.40
    # answers that expression in RETURNING with 1 for every row of this table, NULL error or not.
    rows = [{**item, "batch_id": batch_id, "created_at": created_at} for item in items]
    return conn.execute(_SQLITE_RESULTS, rows).all()


# Built once: constructing a statement per call costs more than a small batch's INSERT itself.
_JOB_INSERTS = {
    name: dialect.insert(tables.jobs)
    .on_conflict_do_nothing(index_elements=["id"])
    .returning(tables.jobs.c.id)
    for name, dialect in (("postgresql", postgresql), ("sqlite", sqlite))
}
_POSTGRESQL_RESULTS = _postgresql_results_statement()
_POSTGRESQL_QUOTED_RESULTS = _postgresql_results_statement(quoted_output=True)
_SQLITE_RESULTS = (
    sqlite.insert(tables.results)
    .on_conflict_do_nothing(index_elements=_RESULT_KEY)
    .returning(tables.results.c.job_id, tables.results.c.error)
)
_TOKEN_UPSERTS = {"postgresql": _token_upsert(postgresql), "sqlite": _token_upsert(sqlite)}
_RESULT_INSERTS: dict[str, Callable[[Connection, list[dict[str, Any]], int | None, datetime], Inserted]] = {
    "postgresql": _insert_results_postgresql,
    "sqlite": _insert_results_sqlite,
}
