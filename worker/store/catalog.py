"""What the HTTP API reads across jobs: a tenant's jobs page by page, its unfinished items, a job's errors
by kind.

Every query here is filtered by tenant or by one job id the caller has already found in its tenant; it
must never import the runtime, the API or a model.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime

import orjson
from sqlalchemy import ColumnElement, Engine, Select, String, func, select, tuple_

from worker.bounds import is_job_id
from worker.store import tables
from worker.store.rows import job_status_of
from worker.store.values import UNFINISHED_STATES, JobState, JobStatus


class InvalidCursor(ValueError):
    """A listing cursor that this store did not hand out."""


@dataclass(frozen=True, slots=True)
class JobPage:
    jobs: list[JobStatus]
    next_cursor: str | None  # None on the last page


class JobCatalog:
    """Tenant-scoped reads over the jobs and results tables of one database."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def page(
        self,
        tenants: Collection[str],
        *,
        state: JobState | None = None,
        limit: int = 50,
        cursor: str | None = None,
    ) -> JobPage:
        """The tenants' jobs, newest first, ``limit`` at a time; pass ``next_cursor`` for the next page.

        A keyset on (created_at, id) rather than an offset: a page costs the same however deep it is, and
        jobs created meanwhile neither repeat nor skip rows of later pages.
        """
        job = tables.jobs.c
        query: Select[tuple[object, ...]] = select(tables.jobs).where(job.tenant.in_(list(tenants)))
        if state is not None:
            query = query.where(job.state == state)
        if cursor is not None:
            created_at, job_id = decode_cursor(cursor)
            query = query.where(tuple_(job.created_at, job.id) < tuple_(created_at, job_id))
        query = query.order_by(job.created_at.desc(), job.id.desc()).limit(limit + 1)
        with self.engine.connect() as conn:
            result = conn.execute(query)
            jobs = [job_status_of(list(result.keys()), row) for row in result]
        if len(jobs) <= limit:
            return JobPage(jobs, None)
        last = jobs[limit - 1]
        return JobPage(jobs[:limit], encode_cursor(last.created_at, last.job_id))

    def unfinished_items(self, tenant: str) -> int:
        """Items of the tenant's queued and running jobs that have no outcome yet."""
        job = tables.jobs.c
        query = select(func.coalesce(func.sum(job.total - job.done - job.failed), 0)).where(
            job.tenant == tenant, job.state.in_(UNFINISHED_STATES)
        )
        with self.engine.connect() as conn:
            return int(conn.execute(query).scalar_one())

    def error_kinds(self, job_id: str) -> dict[str, int]:
        """How many of the job's items failed, by kind: an error's text before its first ':' (for example
        ``invalid input``, ``cancelled``, ``expired``, ``ValueError``)."""
        item = tables.results.c
        with self.engine.connect() as conn:
            kind = _error_kind(item.error, conn.dialect.name)
            query = (
                select(kind, func.count())
                .where(item.job_id == job_id, item.error.is_not(None))
                .group_by(kind)
                .order_by(func.count().desc())
            )
            return {str(name): int(count) for name, count in conn.execute(query)}


def _error_kind(error: ColumnElement[str | None], dialect: str) -> ColumnElement[str]:
    if dialect == "postgresql":
        return func.split_part(error, ":", 1, type_=String())
    # SQLite has no split_part; an error without ':' is all kind.
    return func.substr(error, 1, func.instr(error + ":", ":") - 1, type_=String())


def encode_cursor(created_at: datetime, job_id: str) -> str:
    raw = orjson.dumps([created_at.isoformat(), job_id])
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[datetime, str]:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        created_at, job_id = orjson.loads(raw)
        when = datetime.fromisoformat(created_at)
    except (binascii.Error, ValueError, TypeError) as exc:
        raise InvalidCursor("invalid cursor: pass the next_cursor of a previous page") from exc
    if when.tzinfo is None or not is_job_id(job_id):
        raise InvalidCursor("invalid cursor: pass the next_cursor of a previous page")
    return when, job_id
