"""Values for store tests: jobs, batches and outcomes to write (the ``store`` fixture is in conftest.py)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

from worker.store.results import BatchRecord, ItemRecord, JobSpec, ResultStore


def new_job(total: int = 4, model: str = "minilm", priority: str = "normal") -> JobSpec:
    return JobSpec(job_id=str(uuid.uuid4()), model=model, priority=priority, total=total)


def batch(size: int, started_at: datetime | None = None, model: str = "minilm") -> BatchRecord:
    return BatchRecord(
        model=model,
        lane="short",
        size=size,
        real_tokens=10 * size,
        padded_tokens=16 * size,
        wait_ms=12.5,
        run_ms=3.25,
        started_at=started_at or datetime.now(UTC),
        worker="worker-1@host",
    )


def ok(job: JobSpec, index: int) -> ItemRecord:
    return ItemRecord(job.job_id, index, f"item-{index}", output={"label": "pos", "score": index / 8})


def err(job: JobSpec, index: int) -> ItemRecord:
    return ItemRecord(job.job_id, index, f"item-{index}", error=f"item {index}: input too long")


def write(store: ResultStore, job: JobSpec, outcomes: list[ItemRecord]) -> int:
    return store.write_batch(batch(len(outcomes)), outcomes, [job])
