"""The store's read statements that are more than a line: a job's status (with its token counts) in one
prebuilt query, its most common errors, and what the rows of jobs being written into say (another model or
total than a message claims; cancelled).

Statements and small functions over a connection; the connection, and its transaction, are the caller's.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from sqlalchemy import Connection, Select, String, bindparam, case, func, select

from worker.store import tables
from worker.store.values import JobSpec, JobState

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
