"""submit / status / results / wait / cancel for Python users.

``submit`` checks every item, registers the job, then publishes it in chunks under one job id.
Polling reads SQL only; nothing here talks to a worker.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import replace
from typing import Any, NamedTuple
from uuid import uuid4

from worker.calls import InferCall, check_items, expiry, parse_call
from worker.celery_app import app
from worker.settings import Settings, get_settings
from worker.store.results import JobSpec, JobStatus, ResultStore
from worker.tasks import job_store, publish

FINISHED = frozenset({"succeeded", "failed", "partial", "cancelled"})


class JobNotFound(LookupError):
    pass


class ItemResult(NamedTuple):
    index: int  # type: ignore[assignment]  # shadows tuple.index on purpose: results are (index, ...)
    output: Any
    error: str | None
    item_id: str | None


class Client:
    def __init__(self, settings: Settings | None = None) -> None:
        self.settings = settings or get_settings()

    @property
    def store(self) -> ResultStore:
        return job_store(self.settings.database_url)

    def submit(
        self,
        model: str,
        inputs: Sequence[Any],
        priority: str = "normal",
        deadline_s: float | None = None,
        *,
        tenant: str = "default",
        metadata: Any = None,
    ) -> str:
        """Check all items, register the job, publish it; returns the job id.

        With ``deadline_s``, items not started within that many seconds end as expired errors. ``tenant``
        and ``metadata`` (any JSON value) are stored with the job for the HTTP API.
        """
        job_id = str(uuid4())
        kwargs = {
            "model": model,
            "inputs": list(inputs),
            "priority": priority,
            "expires_at": expiry(deadline_s),
        }
        call = parse_call(job_id, kwargs, self.settings)
        check_items(call, self.settings)
        self.store.create_job(
            JobSpec(job_id, call.model, call.priority, call.total), tenant=tenant, metadata=metadata
        )
        size = self.settings.submit_chunk_size
        chunks = (
            replace(call, inputs=call.inputs[offset : offset + size], offset=offset)
            for offset in range(0, call.total, size)
        )
        self.publish_job(job_id, chunks)
        return job_id

    def publish_job(self, job_id: str, calls: Iterable[InferCall]) -> None:
        """Send the messages of a job already checked and registered (the HTTP API's streamed submit too)."""
        published = 0
        try:
            with app.producer_or_acquire() as producer:
                for call in calls:
                    publish(call, str(uuid4()), producer)
                    published += 1
        except Exception as exc:
            # Messages already sent still run; the job says why it cannot finish.
            self.store.fail_job(job_id, f"submit stopped after {published} messages: {exc}")
            raise

    def status(self, job_id: str) -> JobStatus:
        status = self.store.status(job_id)
        if status is None:
            raise JobNotFound(f"no job {job_id}")
        return status

    def results(self, job_id: str) -> Iterator[ItemResult]:
        """Stored outcomes in index order; items still running are not there yet."""
        self.status(job_id)
        for outcome in self.store.results(job_id):
            yield ItemResult(outcome.index, outcome.output, outcome.error, outcome.item_id)

    def wait(self, job_id: str, timeout_s: float | None = None, poll_s: float = 0.2) -> JobStatus:
        """Poll until the job has finished; TimeoutError after ``timeout_s``."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while (status := self.status(job_id)).state not in FINISHED:
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(
                    f"job {job_id} is still {status.state} ({status.done + status.failed}/{status.total})"
                )
            time.sleep(poll_s)
        return status

    def cancel(self, job_id: str) -> bool:
        """Mark the job cancelled; True unless it had already finished."""
        self.status(job_id)
        return self.store.cancel(job_id)


def _default() -> Client:
    return Client()


def submit(
    model: str, inputs: Sequence[Any], priority: str = "normal", deadline_s: float | None = None
) -> str:
    return _default().submit(model, inputs, priority, deadline_s)


def status(job_id: str) -> JobStatus:
    return _default().status(job_id)


def results(job_id: str) -> Iterator[ItemResult]:
    return _default().results(job_id)


def wait(job_id: str, timeout_s: float | None = None) -> JobStatus:
    return _default().wait(job_id, timeout_s)


def cancel(job_id: str) -> bool:
    return _default().cancel(job_id)
