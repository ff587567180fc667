"""Celery's result API over the batchwork store: ``r = infer.delay(...)``; ``r.state``, ``r.ready()``,
``r.get(timeout=...)``.

A job maps to Celery's states: queued PENDING, running STARTED, succeeded SUCCESS (the outputs in input
order), failed or partial FAILURE (a JobFailed naming the failed items, which still carries every output),
cancelled REVOKED. ``r.revoke()`` cancels the job (``JobResult``). Workers never write through this
backend: results go to SQL with their batch.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Any

from celery import states

from worker.celery_compat import CancellingResult, ReadOnlyBackend, meta
from worker.errors import JobFailed, JobNotFound
from worker.store.values import JobState

_STATES = {
    JobState.QUEUED: states.PENDING,
    JobState.RUNNING: states.STARTED,
    JobState.SUCCEEDED: states.SUCCESS,
    JobState.FAILED: states.FAILURE,
    JobState.PARTIAL: states.FAILURE,
    JobState.CANCELLED: states.REVOKED,
}


class StoreBackend(ReadOnlyBackend):
    """Reads jobs through the jobs port (SQL, and Redis for jobs no worker took yet), as every surface."""

    def task_meta(self, task_id: str) -> dict[str, Any]:
        from worker.jobs import default_jobs

        jobs = default_jobs()
        try:
            job = jobs.status(task_id)
        except JobNotFound:
            return meta(task_id, states.PENDING)  # Celery's answer for an id it does not know
        state = _STATES[job.state]
        if state == states.SUCCESS:
            return meta(task_id, state, [r.output for r in jobs.results(task_id)], job.finished_at)
        if state == states.FAILURE:
            return meta(task_id, state, _failure(task_id, job.total, jobs.results(task_id)), job.finished_at)
        if state == states.REVOKED:
            return meta(task_id, state, JobFailed(f"job {task_id} was cancelled"), job.finished_at)
        return meta(task_id, state)

    def store_result(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            "batchwork workers store results in SQL with their batch, not through Celery"
        )

    def as_uri(self, include_password: bool = False) -> str:
        return "batchwork-store://"


def _failure(task_id: str, total: int, results: Any) -> JobFailed:
    outputs: list[Any] = [None] * total
    errors: dict[int, str] = {}
    for result in results:
        if result.error is None:
            outputs[result.index] = result.output
        else:
            errors[result.index] = result.error
    missing = total - len(errors) - sum(output is not None for output in outputs)
    common = "; ".join(f"{count} × {error}" for error, count in Counter(errors.values()).most_common(3))
    first = ", ".join(map(str, sorted(errors)[:10])) + (", ..." if len(errors) > 10 else "")
    message = f"job {task_id}: {len(errors)} of {total} items failed (items {first}): {common}"
    if missing > 0:
        message += f"; {missing} have no result"
    return JobFailed(message, outputs, errors)


class JobResult(CancellingResult):  # type: ignore[misc]  # celery ships no types
    """Celery's AsyncResult of a batchwork job: ``revoke()`` cancels the job in the store, as
    ``client.cancel`` does. Waiting items end ``cancelled``; ``terminate`` cannot stop a batch already
    running, which finishes and is stored."""

    def cancel(self, task_id: str) -> None:
        from worker.client import default_client

        with contextlib.suppress(JobNotFound):  # as Celery's revoke of an unknown id: nothing to stop
            default_client().cancel(task_id)
