"""ResultStore: jobs, per-item results and batch records in SQL, written one batch per transaction.

It is the end of the flow (runner -> store -> poller) and must never import the runtime, the scheduler or
a model; it takes plain values and gives plain values back. What a user's command reads fails with one line
(DatabaseUnavailable); what a worker writes fails with the driver's own error, which the storer classifies.
"""

from __future__ import annotations

import io
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import replace
from datetime import UTC, datetime
from functools import lru_cache
from itertools import islice
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, inspect, select, text, update
from sqlalchemy.engine import make_url
from sqlalchemy.exc import IntegrityError

from worker.bounds import MAX_COUNT, is_job_id
from worker.store import bulk, rows, tables
from worker.store.db import client_errors, is_duplicate_key, make_engine, shown_url, single_reads
from worker.store.values import (
    FINISHED_STATES,
    UNFINISHED_STATES,
    BatchRecord,
    BatchWrite,
    ItemColumns,
    ItemRecord,
    JobSpec,
    JobState,
    JobStatus,
    Stored,
    TokenCount,
)

__all__ = [
    "FINISHED_STATES",
    "UNFINISHED_STATES",
    "BatchRecord",
    "ItemRecord",
    "JobSpec",
    "JobStatus",
    "ResultStore",
    "Stored",
    "TokenCount",
]

# Rows per query when streaming a job's results: small enough to keep memory flat for a 1M-item job,
# large enough that the round trips don't dominate.
RESULTS_PAGE_SIZE = 2000
# Lines per page when PostgreSQL writes a job's results as NDJSON (result_lines): one text of a few MB.
RESULT_LINES_PAGE_SIZE = 20_000
_JOB = tables.jobs.c
# A worker's store threads on PostgreSQL (see concurrent_writers).
CONCURRENT_WRITERS = 2


class ResultStore:
    """Reads and writes jobs, results and batches through one Engine (PostgreSQL or SQLite)."""

    def __init__(self, engine: Engine, url: str | None = None):
        bulk.check_dialect(engine.dialect.name)
        self.engine = engine
        self.url = url or engine.url.render_as_string(hide_password=False)
        self._single_reads = single_reads(engine)
        self._schema_checked = False

    @property
    def concurrent_writers(self) -> int:
        """How many threads of a worker may write batches at once to good effect: PostgreSQL runs one
        transaction's statements while the next is sent (a SQLite file takes one writer at a time)."""
        return CONCURRENT_WRITERS if self.engine.dialect.name == "postgresql" else 1

    @classmethod
    def from_url(cls, url: str) -> ResultStore:
        return cls(make_engine(url), url)

    @staticmethod
    @lru_cache(maxsize=8)
    def for_url(url: str) -> ResultStore:
        """One store per database URL in a process (producers, pollers): its connections are reused."""
        return ResultStore.from_url(url)

    def close(self) -> None:
        """Close the pooled connections (tests drop their schema afterwards; workers at shutdown)."""
        self.engine.dispose()

    def location(self) -> str:
        """Where this store looks, for a user (no password; says when a SQLite file is absent)."""
        return f"{shown_url(self.url)} (no such file yet)" if self._absent() else shown_url(self.url)

    def has_schema(self) -> bool:
        """Do batchwork's tables exist here (is the database migrated)?"""
        if self._absent():
            return False
        with client_errors(self.url), self.engine.connect() as conn:
            names = set(inspect(conn).get_table_names())
        return {table.name for table in tables.metadata.sorted_tables} <= names

    # -- jobs -----------------------------------------------------------------------------

    def create_job(
        self,
        spec: JobSpec,
        *,
        create_schema: bool = False,
        state: JobState = JobState.QUEUED,
        tenant: str = "default",
        metadata: Any = None,
    ) -> bool:
        """Record a job of ``tenant`` (queued, or e.g. cancelled); False when it already existed (it is left
        as it is). ``create_schema``: a SQLite database without batchwork's tables is created and migrated
        first."""
        if create_schema:
            self.ensure_sqlite_schema()
        row = {**rows.job_row(spec, _utcnow(), state), "tenant": tenant, "metadata": metadata}
        with client_errors(self.url), self.engine.begin() as conn:
            return bool(bulk.insert_jobs(conn, [row]))

    def fail_job(self, job_id: str, error: str) -> None:
        """Mark a job failed as a whole (e.g. its submit could not publish); a finished job is left alone."""
        self._finish(job_id, JobState.FAILED, error)

    def fail_new_job(self, spec: JobSpec, error: str) -> bool:
        """Record a job that failed as a whole before any item ran (a refused message), unless a job with
        its id already exists: a message never changes another job's state."""
        row = {**rows.job_row(spec, _utcnow(), JobState.FAILED), "error": error}
        with self.engine.begin() as conn:
            return bool(bulk.insert_jobs(conn, [row]))

    def cancel(self, job_id: str) -> bool:
        """Cancel a queued or running job; False when it is unknown or already finished."""
        return (
            False
            if self._absent() or not is_job_id(job_id)
            else self._finish(job_id, JobState.CANCELLED, None)
        )

    def status(self, job_id: str, tenants: Collection[str] | None = None) -> JobStatus | None:
        """The job's state, counts and most common errors, or None for a job never recorded here (or, given
        ``tenants``, another tenant's job: the filter is in the query, so another tenant's job is never read).

        One prebuilt query on an autocommit connection (no BEGIN/ROLLBACK): pollers, the HTTP API above all,
        run it many times a second. A failed job's most common errors cost a second query. A string that is
        not a job id (a URL's path, a user's typo) names no job: it never reaches the database.
        """
        if self._absent() or not is_job_id(job_id):
            return None
        params: dict[str, Any] = {"job_key": job_id}
        if tenants is not None:
            params["tenants"] = list(tenants)
        with client_errors(self.url), self._single_reads.connect() as conn:
            row = conn.execute(
                rows.STATUS if tenants is None else rows.STATUS_IN_TENANTS, params
            ).one_or_none()
            if row is None:
                return None
            *fields, items, generated, in_flight = row
            job = rows.job_status_of(row._fields[: len(fields)], fields)
            if job.failed:
                job = replace(job, errors=rows.top_errors(conn, job_id))
        if not items:
            return job
        if job.state in FINISHED_STATES:  # reports of runs that never stored a result no longer count
            generated, in_flight = generated - in_flight, 0
        return replace(job, generated_tokens=generated, running_tokens=in_flight)

    # -- results --------------------------------------------------------------------------

    def write_batch(
        self, record: BatchRecord | None, outcomes: Sequence[ItemRecord], jobs: Sequence[JobSpec]
    ) -> int:
        """Store one batch and its outcomes in one transaction; return how many result rows were new.

        ``record`` is None for outcomes that never reached a model (inputs refused before batching); their
        rows get no batch_id. ``jobs`` must hold a JobSpec for every job in ``outcomes``: a job row missing
        so far is created from it. Outcomes already stored (a redelivered message) are skipped and not
        counted again; outcomes of a job whose row disagrees with its spec are not stored (``Stored``).
        """
        return self.write_batches([(record, outcomes, jobs)]).new_rows[0]

    def write_batches(self, batches: Sequence[BatchWrite]) -> Stored:
        """Several batches as in ``write_batch``, in ONE transaction (small batches pay one commit).

        PostgreSQL first takes every outcome for new, which holds unless a message was redelivered: all the
        batches' rows in one plain INSERT. Should one be stored already, that transaction fails as a whole
        and is written again, each batch skipping what is stored (``bulk.insert_results``)."""
        specs: dict[str, JobSpec] = {}
        columns: list[ItemColumns] = []
        for _, outcomes, jobs in batches:
            mine = {spec.job_id: spec for spec in jobs}
            given = outcomes if isinstance(outcomes, ItemColumns) else ItemColumns.of(outcomes)
            rows.check_specs(given, mine)
            specs.update(mine)
            columns.append(given)
        records = [record for record, _, _ in batches]
        if self.engine.dialect.name == "postgresql":
            try:
                return self._write(records, columns, specs, fresh=True)
            except IntegrityError as exc:
                if not is_duplicate_key(exc):
                    raise
        return self._write(records, columns, specs, fresh=False)

    def _write(
        self,
        records: list[BatchRecord | None],
        columns: list[ItemColumns],
        specs: dict[str, JobSpec],
        *,
        fresh: bool,
    ) -> Stored:
        now = _utcnow()
        ordered = [specs[job_id] for job_id in sorted(specs)]
        if fresh:
            # Every row is new: a job row this write creates holds its counts and state from the start.
            first_counts = [row for given in columns for row in bulk.counted(given)]
            job_rows = rows.counted_job_rows(ordered, first_counts, now)
        else:
            job_rows = [rows.job_row(spec, now) for spec in ordered]
        with self.engine.begin() as conn:
            new_jobs = bulk.insert_jobs(conn, job_rows)
            refused, cancelled = rows.check_jobs(conn, [specs[j] for j in specs if j not in new_jobs])
            kept = [_kept(given, refused, cancelled) for given in columns]
            batch_ids = bulk.insert_batches(conn, records)
            inserted = bulk.insert_results(conn, kept, batch_ids, now, fresh=fresh)
            counted = new_jobs if fresh else set()
            progress = rows.progress_by_job(
                [row for rows_of in inserted for row in rows_of if row[0] not in counted], now
            )
            if len(progress) > 1 and conn.dialect.name == "postgresql":
                conn.execute(rows.PROGRESS_OF_MANY, {"progress": progress, "now": now})
            elif progress:
                conn.execute(rows.PROGRESS, progress)
            finals = [count for items in kept for count in _token_counts(items)]
            bulk.upsert_generated_tokens(conn, rows.token_rows(finals, final=True, now=now))
        counts = [sum(done + failed for _, done, failed in rows_of) for rows_of in inserted]
        return Stored(counts, frozenset(new_jobs), frozenset(refused))

    def record_tokens(self, counts: Sequence[TokenCount]) -> None:
        """Store running items' token counts (an item already stored keeps its final count)."""
        with self.engine.begin() as conn:
            bulk.upsert_generated_tokens(conn, rows.token_rows(counts, final=False, now=_utcnow()))

    def results(self, job_id: str, after: int = -1, before: int | None = None) -> Iterator[ItemRecord]:
        """The job's stored outcomes of index above ``after`` (and below ``before``), ordered by index,
        fetched a page at a time.

        Each page is its own short query (keyset on the primary key), so a slow reader of a 1M-item job
        holds neither a connection nor a transaction between pages.
        """
        if self._absent() or not is_job_id(job_id) or not -1 <= after <= MAX_COUNT:
            return
        column = tables.results.c
        query = (
            select(column.item_index, column.item_id, column.output, column.error)
            .where(column.job_id == job_id)
            .order_by(column.item_index)
            .limit(RESULTS_PAGE_SIZE)
        )
        if before is not None:
            query = query.where(column.item_index < before)
        page_query = query.where(column.item_index > after)
        while True:
            with client_errors(self.url), self.engine.connect() as conn:
                _in_key_order(conn)
                page = conn.execute(page_query).all()
            for index, item_id, output, error in page:
                yield ItemRecord(job_id, index, item_id, output, error)
            if len(page) < RESULTS_PAGE_SIZE:
                return
            page_query = query.where(column.item_index > page[-1].item_index)

    def result_lines(self, job_id: str, after: int = -1, limit: int | None = None) -> Iterator[bytes]:
        """The job's stored outcomes of index above ``after`` (at most ``limit``) as NDJSON lines, as
        ``worker.jsonl.write_results`` writes them, in chunks of whole lines ending in a newline.

        PostgreSQL writes the lines itself, a page to one text (a stored output is JSON text already, so it
        is never decoded and encoded again, and no Python object is made per row); a page is its own short
        query, as in ``results``. SQLite: the rows through ``results``.
        """
        if self.engine.dialect.name != "postgresql":
            yield from _lines_of(self.results(job_id, after), limit)
            return
        left = limit
        while left is None or left > 0:
            size = RESULT_LINES_PAGE_SIZE if left is None else min(left, RESULT_LINES_PAGE_SIZE)
            with client_errors(self.url), self.engine.connect() as conn:
                _in_key_order(conn)
                last, lines, count = conn.execute(
                    _RESULT_LINES, {"job_id": job_id, "after": after, "size": size}
                ).one()
            if not count:
                return
            yield lines.encode() + b"\n"
            if count < size:
                return
            after = last
            left = None if left is None else left - count

    def recent_batches(self, job_id: str | None = None, limit: int = 20) -> list[BatchRecord]:
        """The newest batches first, all of them or only those that carried items of ``job_id``."""
        if self._absent() or (job_id is not None and not is_job_id(job_id)):
            return []
        batch = tables.batches.c
        query = select(tables.batches).order_by(batch.started_at.desc(), batch.id.desc()).limit(limit)
        if job_id is not None:
            item = tables.results.c
            query = query.where(batch.id.in_(select(item.batch_id).where(item.job_id == job_id)))
        with client_errors(self.url), self.engine.connect() as conn:
            found = conn.execute(query).all()
        return [rows.batch_record(row) for row in found]

    # -- what workers ask ---------------------------------------------------------------------

    def unfinished_jobs(self, created_before: datetime, limit: int | None = None) -> list[JobSpec]:
        """Jobs still queued or running that were created before ``created_before`` (the oldest ``limit``)."""
        query = select(_JOB.id, _JOB.model, _JOB.priority, _JOB.total).where(
            _JOB.state.in_(UNFINISHED_STATES), _JOB.created_at < created_before
        )
        if limit is not None:
            query = query.order_by(_JOB.created_at).limit(limit)
        with self.engine.connect() as conn:
            return [JobSpec(*row) for row in conn.execute(query)]

    def missing_indices(self, job_id: str, total: int) -> list[int]:
        """Indices of the job's items that have no stored outcome yet."""
        item = tables.results.c
        with self.engine.connect() as conn:
            stored = set(conn.scalars(select(item.item_index).where(item.job_id == job_id)))
        return [index for index in range(total) if index not in stored]

    def end_missing(self, job: JobSpec, error: str) -> int:
        """Store ``error`` for every item of ``job`` without an outcome (its row made from ``job`` if it has
        none), a page of items per transaction; how many. A finished job keeps its state."""
        missing = self.missing_indices(job.job_id, job.total)
        for start in range(0, len(missing), RESULTS_PAGE_SIZE):
            page = missing[start : start + RESULTS_PAGE_SIZE]
            outcomes = [ItemRecord(job.job_id, index, None, error=error) for index in page]
            self.write_batch(None, outcomes, [job])
        return len(missing)

    def cancelled(self, job_ids: Iterable[str]) -> set[str]:
        """Which of these jobs have been cancelled (the worker drops their waiting items)."""
        ids = list(job_ids)
        if not ids:
            return set()
        query = select(_JOB.id).where(_JOB.id.in_(ids), _JOB.state == JobState.CANCELLED.value)
        with self.engine.connect() as conn:
            return set(conn.scalars(query))

    # -- inside -----------------------------------------------------------------------------

    def _finish(self, job_id: str, state: JobState, error: str | None) -> bool:
        stmt = (
            update(tables.jobs)
            .where(_JOB.id == job_id, _JOB.state.in_(UNFINISHED_STATES))
            .values(state=state.value, error=error, finished_at=_utcnow())
        )
        with client_errors(self.url), self.engine.begin() as conn:
            return conn.execute(stmt).rowcount == 1

    def _absent(self) -> bool:
        """A SQLite file that does not exist: reading it must not create it."""
        parsed = make_url(self.url)
        if parsed.get_backend_name() != "sqlite" or parsed.database in (None, "", ":memory:"):
            return False
        return not Path(parsed.database).exists()

    def ensure_sqlite_schema(self) -> None:
        """A SQLite database gets batchwork's schema on first use (PostgreSQL: `batchwork migrate`)."""
        if self._schema_checked or make_url(self.url).get_backend_name() != "sqlite":
            return
        if self.has_schema():
            self._schema_checked = True
            return
        from worker.store.schema import migrate

        # Several processes may meet the same new file at once (three `batchwork run` in an empty folder):
        # migrate takes the file's lock, and whoever comes second finds the schema made (a no-op upgrade).
        with client_errors(self.url):  # a file SQLite cannot use (read-only, a stale -wal) is one line
            migrate(self.url)
        self._schema_checked = True


def _kept(given: ItemColumns, refused: Collection[str], cancelled: Collection[str]) -> ItemColumns:
    """The rows of ``given`` to store, sorted (``rows.item_rows``): none of a refused job; a cancelled job's
    outputs replaced by the error "cancelled"."""
    if refused:
        given = _without_jobs(given, refused)
    if cancelled:
        # A worker may take a job's messages before it learns of the job's cancel (it asks once a second, for
        # the jobs it holds): whatever ran after the cancel committed is not kept.
        given = _as_cancelled(given, cancelled)
    return rows.item_rows(given)


def _without_jobs(columns: ItemColumns, jobs: Collection[str]) -> ItemColumns:
    """The rows of ``columns`` not of ``jobs``."""
    return ItemColumns.of([o for o in columns.outcomes() if o.job_id not in jobs])


def _as_cancelled(columns: ItemColumns, jobs: Collection[str]) -> ItemColumns:
    """``columns`` with every output of ``jobs`` replaced by the error "cancelled" (errors are kept)."""
    return ItemColumns.of(
        [
            replace(o, output=None, error="cancelled", tokens=None)
            if o.job_id in jobs and o.error is None
            else o
            for o in columns.outcomes()
        ]
    )


def _token_counts(columns: ItemColumns) -> list[TokenCount]:
    """The final token counts these rows carry (generating models)."""
    if columns.tokens is None:
        return []
    rows = zip(columns.job_ids, columns.indices, columns.tokens, strict=True)
    return [TokenCount(job_id, index, tokens) for job_id, index, tokens in rows if tokens is not None]


# One page of a job's results as NDJSON lines in one text, written by PostgreSQL as orjson writes them
# ({"index":0,"id":"a","output":...} or "error" for "output"); the last index, the lines, their count.
_RESULT_LINES = text(
    f"""SELECT max(item_index), string_agg(line, E'\\n' ORDER BY item_index), count(*)
    FROM (
        SELECT item_index,
               '{{"index":' || item_index || ',"id":' || coalesce(to_json(item_id)::text, 'null')
               || CASE WHEN error IS NULL THEN ',"output":' || coalesce(output::text, 'null')
                       ELSE ',"error":' || to_json(error)::text END
               || '}}' AS line
        FROM {tables.results.name}
        WHERE job_id = :job_id AND item_index > :after
        ORDER BY item_index
        LIMIT :size
    ) AS page"""
)


def _in_key_order(conn: Connection) -> None:
    """Make this transaction's page of one job (``item_index > after ORDER BY item_index LIMIT n``) walk the
    primary key in order. PostgreSQL's planner otherwise takes a bitmap scan of every remaining row of the
    job, then sorts them, whenever it believes the job small: a results table not analyzed since it grew, or
    one job of a million rows among many of a few. Each page then reads the rest of the job, and a 1M-item
    job's 500 pages read 250M rows (65 s instead of 5; bench/README.md, "Result pages in key order"). That
    plan needs a sort, so sorting is turned off for the page's transaction only."""
    if conn.dialect.name == "postgresql":
        conn.exec_driver_sql("SET LOCAL enable_sort = off")


def _lines_of(outcomes: Iterator[ItemRecord], limit: int | None) -> Iterator[bytes]:
    from worker.jsonl import write_results

    outcomes = islice(outcomes, limit)
    while chunk := list(islice(outcomes, 1000)):
        out = io.BytesIO()
        write_results(out, chunk)
        yield out.getvalue()


def _utcnow() -> datetime:
    return datetime.now(UTC)
