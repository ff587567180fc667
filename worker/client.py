"""submit / status / results / wait / cancel for Python users (``infer.delay``, the Celery face, is tasks.py).

A call is checked whole here, before anything is enqueued; where the job is recorded and how it is read is
the jobs port's rule (worker/jobs.py), the same for every surface.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any
from uuid import uuid4

from worker.calls import NewJob, check_items, new_job
from worker.errors import InvalidInput, JobNotFound
from worker.jobs import ORDER_WINDOW_CHUNKS, ItemResult, Jobs, default_jobs, length_order
from worker.settings import Settings, get_settings
from worker.store.results import FINISHED_STATES, JobStatus, ResultStore

__all__ = [
    "ORDER_WINDOW_CHUNKS",
    "Client",
    "InvalidInput",
    "ItemResult",
    "JobNotFound",
    "cancel",
    "length_order",
    "results",
    "status",
    "submit",
    "wait",
]


class Client:
    """The Python user's face of the jobs port (worker.jobs.Jobs): checks calls, then enqueues, polls and
    cancels through it."""

    def __init__(self, settings: Settings | None = None, jobs: Jobs | None = None) -> None:
        self.settings = settings or get_settings()
        self.jobs = jobs or Jobs(self.settings)

    @property
    def store(self) -> ResultStore:
        """The job store (batches, schema); a SQLite database is created (and migrated) on first write."""
        return ResultStore.for_url(self.settings.database_url)

    # -- enqueue ------------------------------------------------------------------------------

    def check(
        self, model: str, inputs: Sequence[Any], priority: str = "normal", deadline_s: float | None = None
    ) -> NewJob:
        """The call, every item checked; InvalidInput (naming the item and field) for the first mistake."""
        kwargs = {"model": model, "inputs": inputs, "priority": priority, "deadline_s": deadline_s}
        call = new_job(str(uuid4()), kwargs, self.settings)
        check_items(call, self.settings)
        return call

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
        """Check all items, record the job in SQL, publish it in messages of a bounded size; the job id.

        With ``deadline_s``, items not started within that many seconds end as expired errors. ``tenant``
        and ``metadata`` (any JSON value) are stored with the job for the HTTP API.
        """
        call = self.check(model, inputs, priority, deadline_s)
        return self.jobs.enqueue(call, tenant=tenant, metadata=metadata)

    # -- poll ---------------------------------------------------------------------------------

    def status(self, job_id: str) -> JobStatus:
        """The job's state and counts: from SQL, or from Redis while no worker has taken it yet."""
        return self.jobs.status(job_id)

    def results(self, job_id: str, after: int = -1) -> Iterator[ItemResult]:
        """Stored outcomes in index order (those of index above ``after``); items still running are not
        there yet."""
        return self.jobs.results(job_id, after)

    def wait(self, job_id: str, timeout_s: float | None = None, poll_s: float = 0.2) -> JobStatus:
        """Poll until the job has finished; TimeoutError after ``timeout_s``."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while (status := self.status(job_id)).state not in FINISHED_STATES:
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(
                    f"job {job_id} is still {status.state} ({status.done + status.failed}/{status.total})"
                )
            time.sleep(poll_s)
        return status

    def cancel(self, job_id: str, unfinished: Iterable[tuple[int, str | None]] = ()) -> bool:
        """Mark the job cancelled; True unless it had already finished (see Jobs.cancel)."""
        return self.jobs.cancel(job_id, unfinished)


_DEFAULT: list[Client] = []


def default_client() -> Client:
    """One client per settings object, over the process's one jobs port (Celery's result backend reads
    through it too), so its connections are reused from call to call."""
    jobs = default_jobs()
    if not _DEFAULT or _DEFAULT[0].jobs is not jobs:
        _DEFAULT[:] = [Client(jobs.settings, jobs)]
    return _DEFAULT[0]


def submit(
    model: str, inputs: Sequence[Any], priority: str = "normal", deadline_s: float | None = None
) -> str:
    return default_client().submit(model, inputs, priority, deadline_s)


def status(job_id: str) -> JobStatus:
    return default_client().status(job_id)


def results(job_id: str) -> Iterator[ItemResult]:
    return default_client().results(job_id)


def wait(job_id: str, timeout_s: float | None = None) -> JobStatus:
    return default_client().wait(job_id, timeout_s)


def cancel(job_id: str) -> bool:
    return default_client().cancel(job_id)
