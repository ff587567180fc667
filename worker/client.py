"""submit / status / results / wait / cancel for Python users, and the enqueue path ``infer.delay`` takes.

A call is checked whole before anything is enqueued. ``submit`` records the job in SQL, then publishes its
messages; ``infer.delay`` (one round trip, no SQL) records it in Redis with its message, and the worker that
takes it records it in SQL. Polling reads SQL, and Redis for a job no worker has taken yet.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from datetime import datetime
from functools import cached_property
from typing import Any, NamedTuple
from uuid import uuid4

from worker.bounds import check_json
from worker.broker.keys import Keys
from worker.calls import InferCall, check_items, job_id_of, new_call
from worker.errors import InvalidInput, JobNotFound, NoWorker
from worker.models.registry import model_class
from worker.settings import Settings, get_settings
from worker.store.results import FINISHED_STATES, JobSpec, JobStatus, ResultStore
from worker.store.values import ItemOutcome

__all__ = [
    "Client",
    "InvalidInput",
    "ItemResult",
    "JobNotFound",
    "cancel",
    "results",
    "status",
    "submit",
    "wait",
]

NO_WORKER = (
    "no broker is configured (BATCHWORK_BROKER_URL is memory://), so nothing would ever run this job: "
    "set BATCHWORK_BROKER_URL to a Redis URL and start `batchwork worker`, or use `batchwork run FILE`, "
    "which runs a worker in its own process"
)
# Cancelled items stored per transaction when a producer cancels its own job.
CANCEL_GROUP = 5000


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
        """The job store; a SQLite database is created (and migrated) on first write, never by a read."""
        return ResultStore.for_url(self.settings.database_url)

    # -- enqueue ------------------------------------------------------------------------------

    def check(
        self, model: str, inputs: Sequence[Any], priority: str = "normal", deadline_s: float | None = None
    ) -> InferCall:
        """The call, every item checked; InvalidInput (naming the item and field) for the first mistake."""
        kwargs = {"model": model, "inputs": inputs, "priority": priority, "deadline_s": deadline_s}
        call = new_call(str(uuid4()), kwargs, self.settings)
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
        return self.enqueue(self.check(model, inputs, priority, deadline_s), tenant=tenant, metadata=metadata)

    def enqueue(self, call: InferCall, *, tenant: str = "default", metadata: Any = None) -> str:
        """Record a checked call's job in SQL, then publish its messages; the job id."""
        self.register(call, tenant=tenant, metadata=metadata)
        self.publish(call)
        return call.job_id

    def register(self, call: InferCall, *, tenant: str = "default", metadata: Any = None) -> None:
        """Record the job of a checked call in SQL (``call.total`` items), before any of it is published;
        InvalidInput for metadata the store could not keep."""
        check_json(metadata, "metadata")
        spec = JobSpec(call.job_id, call.model, call.priority, call.total)
        self.store.create_job(spec, create_schema=True, tenant=tenant, metadata=metadata)

    def publish(self, call: InferCall, encoded_parts: Iterable[tuple[int, bytes]] | None = None) -> None:
        """Send the messages of a registered job: ``call``'s items, or its items already encoded as
        ``Publisher.send`` takes them (the HTTP API's spooled lines; needs a broker). A failure part way fails
        the job, saying why, since the messages already sent still run."""
        try:
            if encoded_parts is None:
                self._publish(call, record_job=False)
            else:
                self._publisher.send(call, encoded_parts, task_id=call.job_id)
        except Exception as exc:
            self.store.fail_job(call.job_id, f"submit could not publish every message: {exc}")
            raise

    def delay(self, kwargs: dict[str, Any]) -> str:
        """``infer.delay``'s path: check, then the job's record and its message in one Redis round trip."""
        call = new_call(str(uuid4()), kwargs, self.settings)
        check_items(call, self.settings)
        if self.settings.embedded:
            return self.enqueue(call)
        self._publish(call, record_job=True)
        return call.job_id

    def _publish(self, call: InferCall, *, record_job: bool) -> None:
        if self.settings.embedded:
            from worker.broker.in_process import IN_PROCESS_WORKER, publish_in_process

            if not IN_PROCESS_WORKER.is_set():
                raise NoWorker(NO_WORKER)
            publish_in_process(call, self.settings)
            return
        order = length_order(call, self.settings)
        self._publisher.enqueue(call, task_id=call.job_id, record_job=record_job, order=order)

    @cached_property
    def _publisher(self) -> Any:
        from worker.broker.producer import Publisher

        return Publisher(self.settings.broker_url, Keys.of(self.settings), self.settings.submit_chunk_size)

    @cached_property
    def _pending(self) -> Any:
        from worker.broker.producer import PendingJobs

        return PendingJobs(self.settings.broker_url, Keys.of(self.settings))

    # -- poll ---------------------------------------------------------------------------------

    def status(self, job_id: str) -> JobStatus:
        """The job's state and counts: from SQL, or from Redis while no worker has taken it yet."""
        self._valid(job_id)
        status = self.store.status(job_id)
        if status is None and not self.settings.embedded:
            pending = self._pending.get(job_id)
            if pending is not None:
                return _queued(job_id, pending)
            status = self.store.status(job_id)  # recorded in SQL between the two reads
        if status is None:
            raise JobNotFound(f"no job {job_id} in {self.store.location()}")
        return status

    def results(self, job_id: str, after: int = -1) -> Iterator[ItemResult]:
        """Stored outcomes in index order (those of index above ``after``); items still running are not
        there yet."""
        self.status(job_id)
        for outcome in self.store.results(job_id, after):
            yield ItemResult(outcome.index, outcome.output, outcome.error, outcome.item_id)

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
        """Mark the job cancelled; True unless it had already finished.

        ``unfinished``: items ``(index, user id)`` to store as cancelled now, each unless it already has an
        outcome, for a producer that stops its own job (``batchwork run`` on Ctrl-C): the store then holds
        every item, and a result that arrives later is not stored, so it never disagrees with what the
        producer wrote. A worker stores the items it still holds as cancelled itself, the same way.
        """
        changed = self._cancel(job_id)
        if self.status(job_id).state == "cancelled":
            self._store_cancelled(job_id, unfinished)
        return changed

    def _store_cancelled(self, job_id: str, items: Iterable[tuple[int, str | None]]) -> None:
        status = self.status(job_id)
        spec = JobSpec(job_id, status.model, status.priority, status.total)
        group: list[ItemOutcome] = []
        for index, item_id in items:
            group.append(ItemOutcome(job_id, index, item_id, error="cancelled"))
            if len(group) >= CANCEL_GROUP:
                self.store.write_batch(None, group, [spec])
                group = []
        if group:
            self.store.write_batch(None, group, [spec])

    def _cancel(self, job_id: str) -> bool:
        status = self.status(job_id)
        if self.store.cancel(job_id):
            return True
        if status.state == "queued" and status.started_at is None:
            # Known only to Redis so far: record it in SQL as cancelled; the worker that takes its message
            # finds it so and stores its items as cancelled.
            spec = JobSpec(job_id, status.model, status.priority, status.total)
            return self.store.create_job(spec, state="cancelled") or self.store.cancel(job_id)
        return False

    @staticmethod
    def _valid(job_id: object) -> None:
        try:
            job_id_of(job_id)
        except InvalidInput as exc:
            raise JobNotFound(f"no job {job_id!r}: {exc}") from None


def _queued(job_id: str, record: dict[str, str]) -> JobStatus:
    return JobStatus(
        job_id=job_id,
        model=record.get("model", "?"),
        priority=record.get("priority", "normal"),
        state="queued",
        total=int(record.get("total", 0)),
        done=0,
        failed=0,
        error=None,
        created_at=datetime.fromisoformat(record["created_at"]),
        started_at=None,
        finished_at=None,
    )


_DEFAULT: list[Client] = []


def default_client() -> Client:
    """One client per settings object, so its connections are reused from call to call."""
    settings = get_settings()
    if not _DEFAULT or _DEFAULT[0].settings is not settings:
        _DEFAULT[:] = [Client(settings)]
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


# Items a producer orders by length at a time, in chunks (see length_order).
ORDER_WINDOW_CHUNKS = 8


def length_order(call: InferCall, settings: Settings) -> list[int] | None:
    """The positions of ``call``'s items shortest first within each window of ORDER_WINDOW_CHUNKS messages,
    for a model that batches by length (it has length buckets); None where that changes nothing.

    A worker sorts only the few messages it holds into its buckets; ordered here, every message is already
    near one bucket, so its batches carry little padding, while a large job still comes in many messages
    that spread over all workers, and its results still arrive roughly in index order (window by window).
    Characters stand in for tokens: the producer has no tokenizer, and the order only needs to be close.
    """
    if len(call.inputs) < 2 or not model_class(call.model, settings).bucket_edges:
        return None
    lengths = [_chars(item) for item in call.inputs]
    window = settings.submit_chunk_size * ORDER_WINDOW_CHUNKS
    order: list[int] = []
    for start in range(0, len(lengths), window):
        order += sorted(range(start, min(len(lengths), start + window)), key=lengths.__getitem__)
    return None if all(a < b for a, b in zip(order, order[1:], strict=False)) else order


def _chars(item: object) -> int:
    text = item.get("text") if isinstance(item, dict) else item
    return len(text) if isinstance(text, str) else 0
