"""Bulk INSERT ... ON CONFLICT of job, result and generated-token rows, in the fastest shape each dialect has.

It knows tables and dialects, not job states nor the store's API, and never commits: the caller's
transaction does.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict
from datetime import datetime
from functools import lru_cache
from itertools import chain, compress, repeat
from operator import is_not
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
    insert,
    literal_column,
    select,
    text,
)
from sqlalchemy.dialects import postgresql, sqlite

from worker.store import tables
from worker.store.tables import UtcDateTime
from worker.store.values import BatchRecord, ItemColumns

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


def insert_batches(conn: Connection, records: Sequence[BatchRecord | None]) -> list[int | None]:
    """Insert the batch rows of a write in one statement; each record's id, in the order given (None for
    None: outcomes that never reached a model)."""
    given = [asdict(record) for record in records if record is not None]
    if not given:
        return [None] * len(records)
    if len(given) == 1:
        ids = iter([conn.execute(_INSERT_BATCH, given[0]).scalar_one()])
    else:
        ids = iter(conn.scalars(_INSERT_BATCHES, given).all())
    return [None if record is None else next(ids) for record in records]


def insert_results(
    conn: Connection,
    writes: Sequence[ItemColumns],
    batch_ids: Sequence[int | None],
    created_at: datetime,
    *,
    fresh: bool = False,
) -> list[Inserted]:
    """Insert the result rows of each write (sorted by job and index: the lock order) and count the new
    ones per job, per write.

    ``fresh``: the caller claims no row is stored yet (PostgreSQL only). All writes then go in one plain
    INSERT and are counted here: ON CONFLICT's check of each row and RETURNING made up half of the server's
    time per row (measured: 4.9 vs 2.4 µs of PostgreSQL CPU per row). A row that is there already fails the
    statement with a unique violation (``is_duplicate_key``): the caller writes again without ``fresh``.
    Otherwise each write is one statement that skips stored rows (a redelivered message)."""
    if fresh:
        if conn.dialect.name != "postgresql":
            raise ValueError("a fresh insert of results is PostgreSQL's alone")
        _insert_fresh_postgresql(conn, writes, batch_ids, created_at)
        return [counted(items) for items in writes]
    insert = _RESULT_INSERTS[conn.dialect.name]
    return [
        insert(conn, items, batch_id, created_at) if len(items) else []
        for items, batch_id in zip(writes, batch_ids, strict=True)
    ]


def counted(items: ItemColumns) -> Inserted:
    """Per job: its rows without an error, and with one (every row new). C loops, nothing per row."""
    rows = Counter(items.job_ids)
    failed = Counter(compress(items.job_ids, map(is_not, items.errors, repeat(None))))
    return [(job_id, count - failed[job_id], failed[job_id]) for job_id, count in sorted(rows.items())]


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


# The rows travel as columns, each one JSON array that orjson writes in one call, zipped back into rows by
# ROWS FROM: no Python object is made per row on either side. (One JSON array of row objects for
# json_populate_recordset cost a dict per row here and a RETURNING row per row back; a multi-row VALUES, a
# long query psycopg re-parses each time, was ten times slower still.) A JSON null is SQL NULL, and a json
# (not jsonb) output keeps its text, float digits included.
_ROWS_FROM = """
    FROM ROWS FROM (
        json_array_elements_text(CAST(:job_ids AS json)),
        json_array_elements_text(CAST(:indices AS json)),
        json_array_elements_text(CAST(:item_ids AS json)),
        json_array_elements(CAST(:outputs AS json)),
        json_array_elements_text(CAST(:errors AS json)){batch_ids}
    ) AS r(job_id, item_index, item_id, output, error{batch_id})"""
_RESULT_COLUMNS = (
    f"INSERT INTO {tables.results.name} (job_id, item_index, item_id, output, error, batch_id, created_at)"
)
_RESULT_VALUES = """SELECT r.job_id, r.item_index::integer, r.item_id,
           CASE WHEN json_typeof(r.output) = 'null' THEN NULL ELSE r.output END, r.error"""
_COLUMN_PARAMS = ("job_ids", "indices", "item_ids", "outputs", "errors")


def _postgresql_results_statement() -> TextClause:
    # One batch's rows, skipping those stored already; the new rows are counted per job in the same
    # statement, so nothing comes back per row.
    return text(
        f"""WITH inserted AS (
            {_RESULT_COLUMNS}
            {_RESULT_VALUES}, :batch_id, :created_at
            {_ROWS_FROM.format(batch_ids="", batch_id="")}
            ON CONFLICT (job_id, item_index) DO NOTHING
            RETURNING job_id, error
        )
        SELECT job_id, count(*) FILTER (WHERE error IS NULL), count(*) FILTER (WHERE error IS NOT NULL)
        FROM inserted GROUP BY job_id ORDER BY job_id"""
    ).bindparams(
        bindparam("batch_id", type_=Integer()),
        bindparam("created_at", type_=UtcDateTime()),
        *(bindparam(name, type_=String()) for name in _COLUMN_PARAMS),
    )


def _postgresql_fresh_statement() -> TextClause:
    # The rows of several batches, none stored yet: a plain INSERT, each row's batch id one more column.
    batch_ids = ",\n        json_array_elements_text(CAST(:batch_ids AS json))"
    return text(
        f"""{_RESULT_COLUMNS}
        {_RESULT_VALUES}, r.batch_id::integer, :created_at
        {_ROWS_FROM.format(batch_ids=batch_ids, batch_id=", batch_id")}"""
    ).bindparams(
        bindparam("created_at", type_=UtcDateTime()),
        *(bindparam(name, type_=String()) for name in (*_COLUMN_PARAMS, "batch_ids")),
    )


def _insert_fresh_postgresql(
    conn: Connection, writes: Sequence[ItemColumns], batch_ids: Sequence[int | None], created_at: datetime
) -> None:
    if not any(len(items) for items in writes):
        return
    # The parameter names are ItemColumns' own; the writes' columns are joined in C (chain), not per row.
    params: dict[str, Any] = {
        name: _json(list(chain.from_iterable(getattr(items, name) for items in writes)))
        for name in _COLUMN_PARAMS
    }
    runs = (repeat(batch_id, len(items)) for items, batch_id in zip(writes, batch_ids, strict=True))
    params["batch_ids"] = _json(list(chain.from_iterable(runs)))
    params["created_at"] = created_at
    conn.execute(_POSTGRESQL_FRESH, params)


def _insert_results_postgresql(
    conn: Connection, items: ItemColumns, batch_id: int | None, created_at: datetime
) -> Inserted:
    params: dict[str, Any] = {name: _json(getattr(items, name)) for name in _COLUMN_PARAMS}
    params.update(batch_id=batch_id, created_at=created_at)
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
_POSTGRESQL_FRESH = _postgresql_fresh_statement()
_INSERT_BATCH = insert(tables.batches).returning(tables.batches.c.id)
# One statement for many records, the ids back in the order of the records (SQLAlchemy's insertmanyvalues).
_INSERT_BATCHES = insert(tables.batches).returning(tables.batches.c.id, sort_by_parameter_order=True)
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
