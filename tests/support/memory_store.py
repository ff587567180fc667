"""The result store and the tuned-limits table in memory, for tests of the engine without servers (as
procrastinate's in-memory connector stands in for PostgreSQL).

They implement the runtime's ports (worker/store/ports.py) and the SQL side of the jobs port
(worker.store.ports.JobRecords) with the SQL store's rules: results keyed by
(job, index) and written once, a missing job row made from its spec, a job whose row disagrees with a
message's spec left alone, counters and state moved forward as one transaction would, never back out of a
finished state. Outputs must be JSON as the SQL column would keep them (a ValueError otherwise, which the
store thread treats as that data's fault, as it treats the database refusing it). Thread-safe: the engine
writes from its store thread while a test reads.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

import orjson

from worker.jsonl import format_result
from worker.store.tuned import TunedRow
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


@dataclass
class JobRow:
    spec: JobSpec
    state: JobState = JobState.QUEUED
    done: int = 0
    failed: int = 0
    error: str | None = None
    created_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    running_tokens: dict[int, int] = field(default_factory=dict)  # index -> tokens, for running items
    tenant: str = "default"
    metadata: Any = None
    started_at: datetime | None = None
    finished_at: datetime | None = None


class MemoryStore:
    """What a worker writes and reads, in dicts: jobs by id, outcomes by (job, index), batch records."""

    def __init__(self) -> None:
        self.jobs: dict[str, JobRow] = {}
        self.outcomes: dict[tuple[str, int], ItemRecord] = {}
        self.batches: list[BatchRecord] = []
        self.writes = 0  # transactions that stored something
        self._lock = threading.Lock()

    # -- what a producer does (tests set the scene with these) ---------------------------------------

    def create_job(
        self,
        spec: JobSpec,
        *,
        create_schema: bool = False,
        state: JobState = JobState.QUEUED,
        tenant: str = "default",
        metadata: Any = None,
    ) -> bool:
        with self._lock:
            if spec.job_id in self.jobs:
                return False
            self.jobs[spec.job_id] = JobRow(spec, state, tenant=tenant, metadata=metadata)
            return True

    def cancel(self, job_id: str) -> bool:
        return self._finish(job_id, JobState.CANCELLED, None)

    def fail_job(self, job_id: str, error: str) -> None:
        self._finish(job_id, JobState.FAILED, error)

    def results(self, job_id: str, after: int = -1, before: int | None = None) -> list[ItemRecord]:
        """The job's stored outcomes in index order (of index above ``after`` and below ``before``)."""
        with self._lock:
            found = (
                o
                for (j, i), o in self.outcomes.items()
                if j == job_id and after < i and (before is None or i < before)
            )
            return sorted(found, key=lambda o: o.index)

    def result_lines(self, job_id: str, after: int = -1, limit: int | None = None) -> Iterator[bytes]:
        for outcome in self.results(job_id, after)[:limit]:
            yield format_result(outcome)

    def status(self, job_id: str, tenants: Collection[str] | None = None) -> JobStatus | None:
        with self._lock:
            job = self.jobs.get(job_id)
            if job is None or (tenants is not None and job.tenant not in tenants):
                return None
            return JobStatus(
                job_id=job_id,
                model=job.spec.model,
                priority=job.spec.priority,
                state=job.state,
                total=job.spec.total,
                done=job.done,
                failed=job.failed,
                error=job.error,
                created_at=job.created_at,
                started_at=job.started_at,
                finished_at=job.finished_at,
                tenant=job.tenant,
                metadata=job.metadata,
            )

    def location(self) -> str:
        return "the memory store"

    # -- the worker's port (worker.store.ports.WorkerStore) ------------------------------------------

    def write_batch(
        self, record: BatchRecord | None, outcomes: Sequence[ItemRecord], jobs: Sequence[JobSpec]
    ) -> int:
        return self.write_batches([(record, outcomes, jobs)]).new_rows[0]

    def write_batches(self, batches: Sequence[BatchWrite]) -> Stored:
        given = [_columns(outcomes).outcomes() for _, outcomes, _ in batches]
        specs: dict[str, JobSpec] = {}
        for (_, _, jobs), outcomes in zip(batches, given, strict=True):
            mine = {spec.job_id: spec for spec in jobs}
            missing = {o.job_id for o in outcomes} - mine.keys()
            if missing:
                raise ValueError(f"write_batch got outcomes of job(s) {sorted(missing)} without a JobSpec")
            specs.update(mine)
        for outcomes in given:
            for outcome in outcomes:
                _check_json(outcome)
        with self._lock:  # one transaction: everything checked above, nothing below can fail half way
            new_jobs = {job_id for job_id, spec in specs.items() if self._create(spec)}
            refused = {
                job_id
                for job_id, spec in specs.items()
                if (self.jobs[job_id].spec.model, self.jobs[job_id].spec.total) != (spec.model, spec.total)
            }
            counts = [
                self._insert(record, outcomes, refused)
                for (record, _, _), outcomes in zip(batches, given, strict=True)
            ]
            self.writes += 1
        return Stored(counts, frozenset(new_jobs), frozenset(refused))

    def record_tokens(self, counts: Sequence[TokenCount]) -> None:
        with self._lock:
            for count in counts:
                job = self.jobs.get(count.job_id)
                if job is not None and (count.job_id, count.index) not in self.outcomes:
                    job.running_tokens[count.index] = count.tokens

    def fail_new_job(self, spec: JobSpec, error: str) -> bool:
        with self._lock:
            if spec.job_id in self.jobs:
                return False
            self.jobs[spec.job_id] = JobRow(spec, JobState.FAILED, error=error)
            return True

    def cancelled(self, job_ids: Iterable[str]) -> set[str]:
        with self._lock:
            return {j for j in job_ids if j in self.jobs and self.jobs[j].state == JobState.CANCELLED}

    def unfinished_jobs(self, created_before: datetime, limit: int | None = None) -> list[JobSpec]:
        with self._lock:
            rows = sorted(
                (
                    r
                    for r in self.jobs.values()
                    if r.state in UNFINISHED_STATES and r.created_at < created_before
                ),
                key=lambda r: r.created_at,
            )
        return [replace(r.spec, created_at=None) for r in rows[:limit]]

    def end_missing(self, job: JobSpec, error: str) -> int:
        with self._lock:
            missing = [i for i in range(job.total) if (job.job_id, i) not in self.outcomes]
        self.write_batch(None, [ItemRecord(job.job_id, i, None, error=error) for i in missing], [job])
        return len(missing)

    # -- inside ---------------------------------------------------------------------------------

    def _finish(self, job_id: str, state: JobState, error: str | None) -> bool:
        with self._lock:
            job = self.jobs.get(job_id)
            if job is None or job.state not in UNFINISHED_STATES:
                return False
            job.state, job.error, job.finished_at = state, error, datetime.now(UTC)
            return True

    def _create(self, spec: JobSpec) -> bool:
        if spec.job_id in self.jobs:
            return False
        created = datetime.fromtimestamp(spec.created_at, UTC) if spec.created_at else datetime.now(UTC)
        self.jobs[spec.job_id] = JobRow(spec, created_at=created)
        return True

    def _insert(self, record: BatchRecord | None, outcomes: list[ItemRecord], refused: set[str]) -> int:
        if record is not None:
            self.batches.append(record)
        new = 0
        for outcome in outcomes:
            key = (outcome.job_id, outcome.index)
            if outcome.job_id in refused or key in self.outcomes:
                continue
            self.outcomes[key] = outcome
            self._progress(self.jobs[outcome.job_id], outcome)
            new += 1
        return new

    def _progress(self, job: JobRow, outcome: ItemRecord) -> None:
        """The counters bumped and the state moved forward, never back out of a finished state (as
        worker/store/rows.py's PROGRESS statement does)."""
        job.running_tokens.pop(outcome.index, None)
        job.started_at = job.started_at or datetime.now(UTC)
        if outcome.error is None:
            job.done += 1
        else:
            job.failed += 1
        if job.state in FINISHED_STATES:
            return
        if job.done + job.failed < job.spec.total:
            job.state = JobState.RUNNING
            return
        job.finished_at = datetime.now(UTC)
        if job.failed == 0:
            job.state = JobState.SUCCEEDED
        else:
            job.state = JobState.FAILED if job.done == 0 else JobState.PARTIAL


class MemoryTunedLimits:
    """The tuned-limits table in memory (worker.store.ports.TunedStore)."""

    def __init__(self, batching: dict[str, dict[str, Any]] | None = None, device_kind: str = "cpu") -> None:
        self.device_kind = device_kind
        self.batching = dict(batching or {})  # model -> a BatchingSettings block, as `tune --apply` stores
        self.out_of_memory: list[tuple[str, str, int, str]] = []

    def rows(self, device_kind: str | None = None, model: str | None = None) -> list[TunedRow]:
        if device_kind not in (None, self.device_kind):
            return []
        return [
            TunedRow(name, self.device_kind, block, None, None, None, None, None, None)
            for name, block in sorted(self.batching.items())
            if model in (None, name)
        ]

    def record_out_of_memory(self, model: str, device_kind: str, size: int, worker: str) -> None:
        self.out_of_memory.append((model, device_kind, size, worker))


def _columns(outcomes: Sequence[ItemRecord] | ItemColumns) -> ItemColumns:
    return outcomes if isinstance(outcomes, ItemColumns) else ItemColumns.of(outcomes)


def _check_json(outcome: ItemRecord) -> None:
    try:
        orjson.dumps(outcome.output, option=orjson.OPT_SERIALIZE_NUMPY)
    except TypeError as exc:
        raise ValueError(f"job {outcome.job_id} item {outcome.index}: output is not JSON ({exc})") from None
    if "\x00" in (outcome.error or "") or "\x00" in (outcome.item_id or ""):
        raise ValueError(f"job {outcome.job_id} item {outcome.index}: a NUL character in a text column")
