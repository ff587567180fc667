"""What the engine needs from the database, as two protocols: the result store (outcomes, refused jobs,
token counts, cancellations, lost items) and the tuned-limits table.

The SQL store (worker/store: ResultStore, TunedLimits) implements them, and so does the in-memory store of
the tests (tests/support/memory_store.py), so the engine runs without servers. Plain values only: this
module never imports SQL or a concrete store.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Protocol

from worker.store.values import BatchRecord, BatchWrite, ItemRecord, JobSpec, Stored, TokenCount

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
