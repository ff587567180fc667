"""ResultStore: jobs, per-item results and batch records in SQL, written one batch per transaction.

It is the end of the flow (runner -> store -> poller) and must never import the runtime, the scheduler or
a model; it takes plain values and gives plain values back.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from operator import attrgetter
from typing import Any

from sqlalchemy import (
    Connection,
    Engine,
    Row,
    Select,
    String,
    Update,
    and_,
    bindparam,
    case,
    func,
    insert,
    or_,
    select,
    update,
)

from worker.store import bulk, tables
from worker.store.db import make_engine, single_reads
from worker.store.tables import UtcDateTime

# A job in one of these states never changes state again (late or redelivered results still count).
FINISHED_STATES = ("succeeded", "failed", "partial", "cancelled")
UNFINISHED_STATES = ("queued", "running")

# Rows per query when streaming a job's results: small enough to keep memory flat for a 1M-item job,
# large enough that the round trips don't dominate.
RESULTS_PAGE_SIZE = 2000


@dataclass(frozen=True, slots=True)
class JobSpec:
    """What the worker knows of a job from its messages: enough to create the job row if it is missing."""

    job_id: str
    model: str
    priority: str
    total: int


@dataclass(frozen=True, slots=True)
class ItemOutcome:
    """The result of one item: its output, or the error that stopped it (never both, never neither)."""

    job_id: str
    index: int
    item_id: str | None
    output: Any = None
    error: str | None = None
    tokens: int | None = None  # tokens the model generated for it, for models that generate

    def __post_init__(self) -> None:
        if (self.output is None) == (self.error is None):
            raise ValueError(
                f"job {self.job_id} item {self.index}: set exactly one of output and error "
                f"(output is {'None' if self.output is None else 'set'}, error is {self.error!r})"
            )


@dataclass(frozen=True, slots=True)
class BatchRecord:
    """One forward pass: its model and lane, its size in items and tokens, and its timings."""

    model: str
    lane: str
    size: int
    real_tokens: int
    padded_tokens: int
    wait_ms: float
    run_ms: float
    started_at: datetime
    worker: str


BatchWrite = tuple["BatchRecord | None", Sequence["ItemOutcome"], Sequence["JobSpec"]]


@dataclass(frozen=True, slots=True)
class TokenCount:
    """Tokens generated so far for one running item (a worker's report; the stored result's is final)."""

    job_id: str
    index: int
    tokens: int


@dataclass(frozen=True, slots=True)
class JobStatus:
    job_id: str
    model: str
    priority: str
    state: str
    total: int
    done: int
    failed: int
    error: str | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    # Generation jobs only (None otherwise): tokens generated so far, by stored and by running items, and
    # of those by the running ones (as last reported; 0 once the job has finished).
    generated_tokens: int | None = None
    running_tokens: int | None = None
    tenant: str = "default"
    metadata: Any = None  # the submitter's JSON object, as given


class ResultStore:
    """Reads and writes jobs, results and batches through one Engine (PostgreSQL or SQLite)."""

    def __init__(self, engine: Engine):
        bulk.check_dialect(engine.dialect.name)
        self.engine = engine
        self._single_reads = single_reads(engine)

    @classmethod
    def from_url(cls, url: str) -> ResultStore:
        return cls(make_engine(url))

    def close(self) -> None:
        """Close the pooled connections (tests drop their schema afterwards; workers at shutdown)."""
        self.engine.dispose()

    def create_job(self, spec: JobSpec, *, tenant: str = "default", metadata: Any = None) -> None:
        """Record a queued job of ``tenant``; a job that already exists is left as it is."""
        row = {**_job_row(spec, _utcnow()), "tenant": tenant, "metadata": metadata}
        with self.engine.begin() as conn:
            bulk.insert_jobs(conn, [row])

    def write_batch(
        self, record: BatchRecord | None, outcomes: Sequence[ItemOutcome], jobs: Sequence[JobSpec]
    ) -> int:
        """Store one batch and its outcomes in one transaction; return how many result rows were new.

        ``record`` is None for outcomes that never reached a model (inputs refused before batching); their
        rows get no batch_id. ``jobs`` must hold a JobSpec for every job in ``outcomes``: a job row missing
        so far is created from it. Outcomes already stored (a redelivered message) are skipped and not
        counted again.
        """
        return self.write_batches([(record, outcomes, jobs)])[0]

    def write_batches(self, batches: Sequence[BatchWrite]) -> list[int]:
        """Several batches as in ``write_batch``, in ONE transaction (small batches pay one commit)."""
        specs: dict[str, JobSpec] = {}
        for _, outcomes, jobs in batches:
            mine = {spec.job_id: spec for spec in jobs}
            _check_specs(outcomes, mine)
            specs.update(mine)
        now = _utcnow()
        # Jobs and items go in sorted order so two workers writing overlapping jobs (redelivery) take
        # PostgreSQL's row locks in the same order and cannot deadlock.
        job_rows = [_job_row(specs[job_id], now) for job_id in sorted(specs)]
        counts: list[int] = []
        inserted_all: list[Any] = []
        with self.engine.begin() as conn:
            if job_rows:
                bulk.insert_jobs(conn, job_rows)
            for record, outcomes, _ in batches:
                batch_id = None if record is None else _insert_batch(conn, record)
                inserted = bulk.insert_results(conn, _item_rows(outcomes), batch_id, now)
                counts.append(len(inserted))
                inserted_all.extend(inserted)
            progress = _progress_by_job(inserted_all, now)
            if progress:
                conn.execute(_PROGRESS, progress)
            finals = [o for _, outcomes, _ in batches for o in outcomes if o.tokens is not None]
            bulk.upsert_generated_tokens(conn, _token_rows(finals, final=True, now=now))
        return counts

    def record_tokens(self, counts: Sequence[TokenCount]) -> None:
        """Store running items' token counts (an item already stored keeps its final count)."""
        with self.engine.begin() as conn:
            bulk.upsert_generated_tokens(conn, _token_rows(counts, final=False, now=_utcnow()))

    def status(self, job_id: str, tenants: Collection[str] | None = None) -> JobStatus | None:
        """The job's state and counts, or None for a job never created (or, given ``tenants``, another
        tenant's job: the filter is in the query, so another tenant's job is never even read)."""
        with self._single_reads.connect() as conn:
            if tenants is None:
                row = conn.execute(_STATUS, {"job_key": job_id}).one_or_none()
            else:
                params = {"job_key": job_id, "tenants": list(tenants)}
                row = conn.execute(_STATUS_IN_TENANTS, params).one_or_none()
        if row is None:
            return None
        *fields, items, generated, in_flight = row
        job = job_status_of(row._fields[: len(fields)], fields)
        if not items:
            return job
        if job.state in FINISHED_STATES:  # reports of runs that never stored a result no longer count
            generated, in_flight = generated - in_flight, 0
        return replace(job, generated_tokens=generated, running_tokens=in_flight)

    def results(self, job_id: str, after: int = -1) -> Iterator[ItemOutcome]:
        """The job's stored outcomes of index above ``after``, ordered by index, fetched a page at a time.

        Each page is its own short query (keyset on the primary key), so a slow reader of a 1M-item job
        holds neither a connection nor a transaction between pages.
        """
        column = tables.results.c
        query = (
            select(column.item_index, column.item_id, column.output, column.error)
            .where(column.job_id == job_id)
            .order_by(column.item_index)
            .limit(RESULTS_PAGE_SIZE)
        )
        page_query = query.where(column.item_index > after)
        while True:
            with self.engine.connect() as conn:
                page = conn.execute(page_query).all()
            for index, item_id, output, error in page:
                yield ItemOutcome(job_id, index, item_id, output, error)
            if len(page) < RESULTS_PAGE_SIZE:
                return
            page_query = query.where(column.item_index > page[-1].item_index)

    def fail_job(self, job_id: str, error: str) -> None:
        """Mark a job failed as a whole (e.g. its submit could not publish); a finished job is left alone."""
        self._finish(job_id, "failed", error)

    def cancel(self, job_id: str) -> bool:
        """Cancel a queued or running job; False when it is unknown or already finished."""
        return self._finish(job_id, "cancelled", None)

    def recent_batches(self, job_id: str | None = None, limit: int = 20) -> list[BatchRecord]:
        """The newest batches first, all of them or only those that carried items of ``job_id``."""
        batch = tables.batches.c
        query = select(tables.batches).order_by(batch.started_at.desc(), batch.id.desc()).limit(limit)
        if job_id is not None:
            item = tables.results.c
            query = query.where(batch.id.in_(select(item.batch_id).where(item.job_id == job_id)))
        with self.engine.connect() as conn:
            rows = conn.execute(query).all()
        return [_batch_record(row) for row in rows]

    def unfinished_jobs(self, created_before: datetime) -> list[JobSpec]:
        """Jobs still queued or running that were created before ``created_before``."""
        job = tables.jobs.c
        query = select(job.id, job.model, job.priority, job.total).where(
            job.state.in_(UNFINISHED_STATES), job.created_at < created_before
        )
        with self.engine.connect() as conn:
            return [JobSpec(*row) for row in conn.execute(query)]

    def missing_indices(self, job_id: str, total: int) -> list[int]:
        """Indices of the job's items that have no stored outcome yet."""
        item = tables.results.c
        with self.engine.connect() as conn:
            stored = set(conn.scalars(select(item.item_index).where(item.job_id == job_id)))
        return [index for index in range(total) if index not in stored]

    def cancelled(self, job_ids: Iterable[str]) -> set[str]:
        """Which of these jobs have been cancelled (the worker drops their waiting items)."""
        ids = list(job_ids)
        if not ids:
            return set()
        job = tables.jobs.c
        query = select(job.id).where(job.id.in_(ids), job.state == "cancelled")
        with self.engine.connect() as conn:
            return set(conn.scalars(query))

    def _finish(self, job_id: str, state: str, error: str | None) -> bool:
        job = tables.jobs.c
        stmt = (
            update(tables.jobs)
            .where(job.id == job_id, job.state.in_(UNFINISHED_STATES))
            .values(state=state, error=error, finished_at=_utcnow())
        )
        with self.engine.begin() as conn:
            return conn.execute(stmt).rowcount == 1


def _progress_statement() -> Update:
    """One job's counters bumped by its newly inserted rows, and its state moved forward (never back)."""
    job = tables.jobs.c
    done = job.done + bindparam("new_done")
    failed = job.failed + bindparam("new_failed")
    now = bindparam("now", type_=UtcDateTime())
    # or_ rather than in_: an IN list is an "expanding" parameter, which executemany cannot take.
    finished = or_(*(job.state == state for state in FINISHED_STATES))
    complete = done + failed >= job.total
    # Every right-hand side reads the row as it was before this UPDATE, on PostgreSQL and SQLite alike.
    state = case(
        (finished, job.state),
        (~complete, "running"),
        (failed == 0, "succeeded"),
        (done == 0, "failed"),
        else_="partial",
    )
    return (
        update(tables.jobs)
        .where(job.id == bindparam("job_key"))
        .values(
            done=done,
            failed=failed,
            state=state,
            started_at=func.coalesce(job.started_at, now),
            finished_at=case((and_(~finished, complete), now), else_=job.finished_at),
        )
    )


def _status_statement() -> Select[Any]:
    """A job's row and its generated-token counts in one query: pollers (the HTTP API above all) run it
    many times a second, so it is one round trip, built once."""
    tokens = tables.generated_tokens.c
    job_key = bindparam("job_key", type_=String())
    running = func.sum(case((tokens.final, 0), else_=tokens.tokens))
    counts = (
        select(tokens.job_id, func.count(), func.sum(tokens.tokens), running)
        .where(tokens.job_id == job_key)
        .group_by(tokens.job_id)
        .subquery()
    )
    return (
        select(tables.jobs, *list(counts.c)[1:])
        .outerjoin(counts, counts.c.job_id == tables.jobs.c.id)
        .where(tables.jobs.c.id == job_key)
    )


_PROGRESS = _progress_statement()
_STATUS = _status_statement()
_STATUS_IN_TENANTS = _STATUS.where(tables.jobs.c.tenant.in_(bindparam("tenants", expanding=True)))
_INSERT_BATCH = insert(tables.batches).returning(tables.batches.c.id)


def _utcnow() -> datetime:
    return datetime.now(UTC)


def _check_specs(outcomes: Sequence[ItemOutcome], specs: dict[str, JobSpec]) -> None:
    missing = {outcome.job_id for outcome in outcomes} - specs.keys()
    if missing:
        raise ValueError(f"write_batch got outcomes of job(s) {sorted(missing)} without a JobSpec for them")


def _insert_batch(conn: Connection, record: BatchRecord) -> int:
    return conn.execute(_INSERT_BATCH, asdict(record)).scalar_one()


def _job_row(spec: JobSpec, now: datetime) -> dict[str, Any]:
    return {
        "id": spec.job_id,
        "model": spec.model,
        "priority": spec.priority,
        "state": "queued",
        "total": spec.total,
        "done": 0,
        "failed": 0,
        "created_at": now,
    }


def _item_rows(outcomes: Sequence[ItemOutcome]) -> list[dict[str, Any]]:
    # Sorted for the lock order (see write_batch).
    return [
        {
            "job_id": outcome.job_id,
            "item_index": outcome.index,
            "item_id": outcome.item_id,
            "output": outcome.output,
            "error": outcome.error,
        }
        for outcome in sorted(outcomes, key=attrgetter("job_id", "index"))
    ]


def _token_rows(
    counts: Iterable[ItemOutcome | TokenCount], *, final: bool, now: datetime
) -> list[dict[str, Any]]:
    # Sorted for the lock order (see write_batch).
    rows = {
        (count.job_id, count.index): {
            "job_id": count.job_id,
            "item_index": count.index,
            "tokens": count.tokens,
            "final": final,
            "updated_at": now,
        }
        for count in counts
    }
    return [rows[key] for key in sorted(rows)]


def _progress_by_job(inserted: bulk.Inserted, now: datetime) -> list[dict[str, Any]]:
    """UPDATE parameters for each job that got new rows, in job id order (see write_batch)."""
    done: Counter[str] = Counter()
    failed: Counter[str] = Counter()
    for job_id, error in inserted:
        (done if error is None else failed)[job_id] += 1
    return [
        {"job_key": job_id, "new_done": done[job_id], "new_failed": failed[job_id], "now": now}
        for job_id in sorted(done.keys() | failed.keys())
    ]


def job_status_of(names: Sequence[str], values: Sequence[Any]) -> JobStatus:
    """A JobStatus from a jobs row's column names and values."""
    fields = dict(zip(names, values, strict=True))
    fields["job_id"] = fields.pop("id")
    return JobStatus(**fields)


def _batch_record(row: Row[Any]) -> BatchRecord:
    values = dict(row._mapping)
    del values["id"]
    return BatchRecord(**values)
