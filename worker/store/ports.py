"""What a store backend provides, as three protocols: the result store as a worker's threads use it
(outcomes, refused jobs, token counts, cancellations, lost items), the tuned-limits table, and the job
records the jobs port reads and writes (worker/jobs.py).

The SQL store (ResultStore, TunedLimits: PostgreSQL or SQLite) implements them, and so does the in-memory
store of the tests (tests/support/memory_store.py), so the engine runs without servers: a new backend
implements these three. Plain values only: this module never imports SQL or a concrete store.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, Protocol

from worker.store.api_keys import DEFAULT_TENANT
from worker.store.values import (
    BatchRecord,
    BatchWrite,
    ItemRecord,
    JobSpec,
    JobState,
    JobStatus,
    Stored,
    TokenCount,
)

if TYPE_CHECKING:
    from worker.store.tuned import TunedRow


class WorkerStore(Protocol):
    """The result store as a worker's threads use it. Writes are idempotent per (job, index): an outcome
    already stored (a redelivered message) is skipped and not counted again."""

    def write_batches(self, batches: Sequence[BatchWrite]) -> Stored:
        """Several batches (record, outcomes, a JobSpec per job among them) in one transaction; a job row
        still missing is created from its spec; outcomes of a job whose row disagrees with the spec (another
        model or total) are not stored (``Stored.refused_jobs``)."""
        ...

    def write_batch(
        self, record: BatchRecord | None, outcomes: Sequence[ItemRecord], jobs: Sequence[JobSpec]
    ) -> int:
        """One batch as in ``write_batches``; how many result rows were new."""
        ...

    def record_tokens(self, counts: Sequence[TokenCount]) -> None:
        """Running items' token counts (progress only; a stored item keeps its final count)."""
        ...

    def fail_new_job(self, spec: JobSpec, error: str) -> bool:
        """Record a job that failed whole before any item ran, unless its id exists (False then)."""
        ...

    def cancelled(self, job_ids: Iterable[str]) -> set[str]:
        """Which of these jobs were cancelled."""
        ...

    def unfinished_jobs(self, created_before: datetime, limit: int | None = None) -> list[JobSpec]:
        """Jobs still queued or running created before ``created_before`` (the oldest ``limit``)."""
        ...

    def end_missing(self, job: JobSpec, error: str) -> int:
        """Store ``error`` for every item of ``job`` without an outcome; how many."""
        ...


class TunedStore(Protocol):
    """The limits `batchwork tune --apply` stored, and the batch sizes that ran out of memory."""

    def rows(self, device_kind: str | None = None, model: str | None = None) -> list[TunedRow]: ...

    def record_out_of_memory(self, model: str, device_kind: str, size: int, worker: str) -> None: ...


class JobRecords(Protocol):
    """Where jobs live in SQL: worker.store.results.ResultStore, or the tests' MemoryStore."""

    def create_job(
        self,
        spec: JobSpec,
        *,
        create_schema: bool = False,
        state: JobState = JobState.QUEUED,
        tenant: str = DEFAULT_TENANT,
        metadata: Any = None,
    ) -> bool: ...

    def fail_job(self, job_id: str, error: str) -> None: ...

    def cancel(self, job_id: str) -> bool: ...

    def status(self, job_id: str, tenants: Collection[str] | None = None) -> JobStatus | None: ...

    def results(self, job_id: str, after: int = -1, before: int | None = None) -> Iterator[ItemRecord]: ...

    def result_lines(self, job_id: str, after: int = -1, limit: int | None = None) -> Iterator[bytes]: ...

    def write_batch(
        self, record: BatchRecord | None, outcomes: Sequence[ItemRecord], jobs: Sequence[JobSpec]
    ) -> int: ...

    def location(self) -> str: ...
