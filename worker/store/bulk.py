"""Bulk INSERT ... ON CONFLICT of job, result and generated-token rows, in the fastest shape each dialect has.

It knows tables and dialects, not job states nor the store's API, and never commits: the caller's
transaction does.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from functools import lru_cache
from typing import Any

import orjson
from sqlalchemy import (
    JSON,
    Connection,
    Insert,
    Integer,
    String,
    TextClause,
    bindparam,
    func,
    literal_column,
    select,
    text,
)
from sqlalchemy.dialects import postgresql, sqlite

from worker.store import tables
from worker.store.tables import UtcDateTime
from worker.store.values import ItemColumns

SUPPORTED_DIALECTS = ("postgresql", "sqlite")

# The result columns that differ per item, as ItemColumns holds them.
ITEM_FIELDS = ("job_id", "item_index", "item_id", "output", "error")

# Per job that got new rows: (job_id, new rows without error, new rows with one). Rows already there
# (redelivered items) are not counted.
Inserted = list[tuple[str, int, int]]

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
    conn: Connection, items: ItemColumns, batch_id: int | None, created_at: datetime
) -> Inserted:
    """Insert the result rows not stored yet (``items`` sorted by job and index: the lock order) and count
    the new ones per job."""
    if not len(items):
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


def _postgresql_results_statement() -> TextClause:
    # The rows travel as columns, each one JSON array that orjson writes in one call, zipped back into rows
    # by ROWS FROM; the new rows are counted per job in the same statement, so nothing comes back per row.
    # No Python object is made per row on either side. (One JSON array of row objects for
    # json_populate_recordset cost a dict per row here and a RETURNING row per row back; a multi-row
    # VALUES, a long query psycopg re-parses each time, was ten times slower still.) A JSON null is SQL
    # NULL, and a json (not jsonb) output keeps its text, float digits included.
    table = tables.results.name
    return text(
        f"""WITH inserted AS (
            INSERT INTO {table} (job_id, item_index, item_id, output, error, batch_id, created_at)
            SELECT r.job_id, r.item_index::integer, r.item_id,
                   CASE WHEN json_typeof(r.output) = 'null' THEN NULL ELSE r.output END,
                   r.error, :batch_id, :created_at
            FROM ROWS FROM (
                json_array_elements_text(CAST(:job_ids AS json)),
                json_array_elements_text(CAST(:indices AS json)),
                json_array_elements_text(CAST(:item_ids AS json)),
                json_array_elements(CAST(:outputs AS json)),
                json_array_elements_text(CAST(:errors AS json))
            ) AS r(job_id, item_index, item_id, output, error)
            ON CONFLICT (job_id, item_index) DO NOTHING
            RETURNING job_id, error
        )
        SELECT job_id, count(*) FILTER (WHERE error IS NULL), count(*) FILTER (WHERE error IS NOT NULL)
        FROM inserted GROUP BY job_id ORDER BY job_id"""
    ).bindparams(
        bindparam("batch_id", type_=Integer()),
        bindparam("created_at", type_=UtcDateTime()),
        *(
            bindparam(name, type_=String())
            for name in ("job_ids", "indices", "item_ids", "outputs", "errors")
        ),
    )


def _insert_results_postgresql(
    conn: Connection, items: ItemColumns, batch_id: int | None, created_at: datetime
) -> Inserted:
    params = {
        "job_ids": _json(items.job_ids),
        "indices": _json(items.indices),
        "item_ids": _json(items.item_ids),
        "outputs": _json(items.outputs),
        "errors": _json(items.errors),
        "batch_id": batch_id,
        "created_at": created_at,
    }
    return [(job_id, done, failed) for job_id, done, failed in conn.execute(_POSTGRESQL_RESULTS, params)]


def _json(values: list[Any]) -> str:
    return orjson.dumps(values, option=orjson.OPT_SERIALIZE_NUMPY).decode()


def _insert_results_sqlite(
    conn: Connection, items: ItemColumns, batch_id: int | None, created_at: datetime
) -> Inserted:
    # An executemany that SQLAlchemy's insertmanyvalues sends as multi-row INSERTs, each within SQLite's
    # bound-parameter limit. RETURNING gives the error itself, not `error IS NOT NULL`: SQLite 3.40
    # answers that expression in RETURNING with 1 for every row of this table, NULL error or not.
    columns = (items.job_ids, items.indices, items.item_ids, items.outputs, items.errors)
    rows = [
        {"job_id": j, "item_index": i, "item_id": d, "output": o, "error": e, "batch_id": batch_id,
         "created_at": created_at}
        for j, i, d, o, e in zip(*columns, strict=True)
    ]  # fmt: skip
    counts: dict[str, list[int]] = {}
    for job_id, error in conn.execute(_SQLITE_RESULTS, rows):
        counts.setdefault(job_id, [0, 0])[error is not None] += 1
    return [(job_id, done, failed) for job_id, (done, failed) in sorted(counts.items())]


# Built once: constructing a statement per call costs more than a small batch's INSERT itself.
_JOB_INSERTS = {
    name: dialect.insert(tables.jobs)
    .on_conflict_do_nothing(index_elements=["id"])
    .returning(tables.jobs.c.id)
    for name, dialect in (("postgresql", postgresql), ("sqlite", sqlite))
}
_POSTGRESQL_RESULTS = _postgresql_results_statement()
_SQLITE_RESULTS = (
    sqlite.insert(tables.results)
    .on_conflict_do_nothing(index_elements=_RESULT_KEY)
    .returning(tables.results.c.job_id, tables.results.c.error)
)
_TOKEN_UPSERTS = {"postgresql": _token_upsert(postgresql), "sqlite": _token_upsert(sqlite)}
_RESULT_INSERTS: dict[str, Callable[[Connection, ItemColumns, int | None, datetime], Inserted]] = {
    "postgresql": _insert_results_postgresql,
    "sqlite": _insert_results_sqlite,
}
