"""Rows in and out, and the statements beyond a line: the parameters of each statement the store runs, values
read back from rows, a write's progress UPDATE, a job's status (with its token counts) in one prebuilt
query, its most common errors, and what the rows of jobs being written into say (another model or total
than a message claims; cancelled).

Translation between values (store/values.py) and table rows, and statements; no connection is opened here:
the functions that read take the caller's connection, and its transaction.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from typing import Any, NamedTuple

from sqlalchemy import (
    JSON,
    Connection,
    Integer,
    Row,
    Select,
    String,
    Update,
    and_,
    bindparam,
    case,
    column,
    func,
    or_,
    select,
    update,
)

from worker.store import bulk, tables
from worker.store.tables import UtcDateTime
from worker.store.values import (
    FINISHED_STATES,
    BatchRecord,
    ItemColumns,
    ItemRecord,
    JobSpec,
    JobState,
    JobStatus,
    TokenCount,
)


def _progress_statement(given: Any = None) -> Update:
    """One job's counters bumped by its newly inserted rows, and its state moved forward (never back).

    ``given``: a row source with columns job_key, new_done, new_failed, for one statement over many jobs;
    None: they are parameters, for an executemany.
    """
    job = tables.jobs.c
    key = bindparam("job_key") if given is None else given.c.job_key
    done = job.done + (bindparam("new_done") if given is None else given.c.new_done)
    failed = job.failed + (bindparam("new_failed") if given is None else given.c.new_failed)
    now = bindparam("now", type_=UtcDateTime())
    # or_ rather than in_: an IN list is an "expanding" parameter, which executemany cannot take.
    finished = or_(*(job.state == state for state in FINISHED_STATES))
    complete = done + failed >= job.total
    # Every right-hand side reads the row as it was before this UPDATE, on PostgreSQL and SQLite alike.
    state = case(
        (finished, job.state),
        (~complete, JobState.RUNNING.value),
        (failed == 0, JobState.SUCCEEDED.value),
        (done == 0, JobState.FAILED.value),
        else_=JobState.PARTIAL.value,
    )
    return (
        update(tables.jobs)
        .where(job.id == key)
        .values(
            done=done,
            failed=failed,
            state=state,
            started_at=func.coalesce(job.started_at, now),
            finished_at=case((and_(~finished, complete), now), else_=job.finished_at),
        )
    )


def _progress_of_many() -> Update:
    # PostgreSQL: the jobs of a whole write (one per item, for single-item calls) in one UPDATE ... FROM a
    # JSON array, rather than one UPDATE per job.
    given = (
        func.json_to_recordset(bindparam("progress", type_=JSON()))
        .table_valued(column("job_key", String), column("new_done", Integer), column("new_failed", Integer))
        .render_derived(name="given", with_types=True)
    )
    return _progress_statement(given)


PROGRESS = _progress_statement()
PROGRESS_OF_MANY = _progress_of_many()


def job_row(spec: JobSpec, now: datetime, state: JobState = JobState.QUEUED) -> dict[str, Any]:
    return {
        "id": spec.job_id,
        "model": spec.model,
        "priority": spec.priority,
        "state": state.value,
        "total": spec.total,
        "done": 0,
        "failed": 0,
        "created_at": now if spec.created_at is None else datetime.fromtimestamp(spec.created_at, UTC),
        "finished_at": None if state == JobState.QUEUED else now,
    }


def counted_job_rows(
    specs: Iterable[JobSpec], counts: Iterable[tuple[str, int, int]], now: datetime
) -> list[dict[str, Any]]:
    """Job rows (as ``job_row``) to create with their first outcomes counted in: what PROGRESS makes of a
    queued row, so that a job a write creates needs no UPDATE after (single-item calls: one job per item).
    ``counts``: (job_id, done, failed), a job any number of times."""
    done: Counter[str] = Counter()
    failed: Counter[str] = Counter()
    for job_id, new_done, new_failed in counts:
        done[job_id] += new_done
        failed[job_id] += new_failed
    found = []
    for spec in specs:
        row = {**job_row(spec, now), "started_at": None}
        ok, bad = done[spec.job_id], failed[spec.job_id]
        if ok + bad:
            complete = ok + bad >= spec.total
            row.update(state=_first_state(complete, ok, bad), done=ok, failed=bad, started_at=now)
            row["finished_at"] = now if complete else None
        found.append(row)
    return found


def _first_state(complete: bool, done: int, failed: int) -> str:
    """A queued job's state once it has outcomes (as PROGRESS's CASE has it)."""
    if not complete:
        return "running"
    if not failed:
        return "succeeded"
    return "failed" if not done else "partial"


def item_rows(outcomes: ItemColumns) -> ItemColumns:
    """The rows sorted by job and index, so two workers writing overlapping jobs (redelivery) take
    PostgreSQL's row locks in the same order and cannot deadlock. A write of one message's items is sorted
    already, and is checked in one pass, not sorted again."""
    ids, indices = outcomes.job_ids, outcomes.indices
    if _ascending(list(zip(ids, indices, strict=True)) if len(set(ids)) > 1 else indices):
        return outcomes
    order = sorted(range(len(indices)), key=lambda i: (ids[i], indices[i]))
    tokens = outcomes.tokens
    return ItemColumns(
        [ids[i] for i in order],
        [indices[i] for i in order],
        [outcomes.item_ids[i] for i in order],
        [outcomes.outputs[i] for i in order],
        [outcomes.errors[i] for i in order],
        None if tokens is None else [tokens[i] for i in order],
    )


def _ascending(keys: list[Any]) -> bool:
    """Whether ``keys`` are in order already (equal keys too: a stable sort would leave them as they are).
    ``sorted`` of a sorted list is one pass in C; a comparison per row in Python cost more than the sort."""
    return keys == sorted(keys)


def token_rows(
    counts: Iterable[ItemRecord | TokenCount], *, final: bool, now: datetime
) -> list[dict[str, Any]]:
    # Sorted for the lock order (see item_rows).
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


def progress_by_job(inserted: bulk.Inserted, now: datetime) -> list[dict[str, Any]]:
    """UPDATE parameters for each job that got new rows, in job id order (see item_rows)."""
    done: Counter[str] = Counter()
    failed: Counter[str] = Counter()
    for job_id, new_done, new_failed in inserted:
        done[job_id] += new_done
        failed[job_id] += new_failed
    return [
        {"job_key": job_id, "new_done": done[job_id], "new_failed": failed[job_id], "now": now}
        for job_id in sorted(done.keys() | failed.keys())
    ]


def job_status_of(names: Sequence[str], values: Sequence[Any]) -> JobStatus:
    """A JobStatus from a jobs row's column names and values."""
    fields = dict(zip(names, values, strict=True))
    fields["job_id"] = fields.pop("id")
    fields["state"] = JobState(fields["state"])
    return JobStatus(**fields)


def batch_record(row: Row[Any]) -> BatchRecord:
    values = dict(row._mapping)
    del values["id"]
    return BatchRecord(**values)


def check_specs(outcomes: ItemColumns, specs: dict[str, JobSpec]) -> None:
    missing = set(outcomes.job_ids) - specs.keys()
    if missing:
        raise ValueError(f"write_batch got outcomes of job(s) {sorted(missing)} without a JobSpec for them")


# -- reads: a job's status and errors, and the rows of jobs a write goes into ----------------------------

# How many of a failed job's most common errors status reports.
TOP_ERRORS = 5
_JOB = tables.jobs.c


class JobChecks(NamedTuple):
    """What the rows of existing jobs say about a write into them."""

    disagreeing: set[str]  # the row names another model or total than the messages: refuse the write
    cancelled: set[str]  # the job was cancelled: what its items produced is stored as "cancelled"


def check_jobs(conn: Connection, specs: list[JobSpec]) -> JobChecks:
    """Read the rows of these jobs once and say which may not be written into and which were cancelled."""
    if not specs:
        return JobChecks(set(), set())
    found = conn.execute(
        select(_JOB.id, _JOB.model, _JOB.total, _JOB.state).where(
            _JOB.id.in_([spec.job_id for spec in specs])
        )
    )
    stored = {job_id: (model, total, state) for job_id, model, total, state in found}
    disagreeing, cancelled = set(), set()
    for spec in specs:
        model, total, state = stored.get(spec.job_id, (spec.model, spec.total, None))
        if (model, total) != (spec.model, spec.total):
            disagreeing.add(spec.job_id)
        elif state == JobState.CANCELLED:
            cancelled.add(spec.job_id)
    return JobChecks(disagreeing, cancelled)


def top_errors(conn: Connection, job_id: str) -> tuple[tuple[str, int], ...]:
    item = tables.results.c
    count = func.count().label("items")
    query = (
        select(item.error, count)
        .where(item.job_id == job_id, item.error.is_not(None))
        .group_by(item.error)
        .order_by(count.desc(), item.error)
        .limit(TOP_ERRORS)
    )
    return tuple((error, items) for error, items in conn.execute(query))


def _status_statement() -> Select[Any]:
    """A job's row and its generated-token counts in one query."""
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


STATUS = _status_statement()
STATUS_IN_TENANTS = STATUS.where(tables.jobs.c.tenant.in_(bindparam("tenants", expanding=True)))
