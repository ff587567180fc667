"""Jobs: the one port through which every surface enqueues, reads and cancels a job: the Python client,
``infer.delay``, the CLI, the HTTP API and its OpenAI surface, Celery's result backend.

The one rule for where a job is first recorded: its producer records it in SQL before any message of it is
published, except ``infer.delay`` (one Redis round trip, no SQL), whose job is a Redis record written in the
same transaction as its message; the worker that stores the job's first item creates its SQL row and drops
the record. So every reader looks SQL, then Redis, then SQL again (the job may move between the two reads),
and a queued job reads the same on every surface. It never runs a model and never imports the runtime.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Collection, Iterable, Iterator
from datetime import datetime
from functools import cached_property
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from worker.bounds import check_json, is_count, is_job_id, unstorable
from worker.errors import InvalidInput, JobNotFound, NoWorker
from worker.models.registry import model_class
from worker.settings import Settings, get_settings
from worker.store.api_keys import DEFAULT_TENANT, TENANT_PATTERN
from worker.store.ports import JobRecords
from worker.store.values import ItemRecord, JobSpec, JobState, JobStatus

if TYPE_CHECKING:
    from worker.calls import NewJob
    from worker.store.catalog import JobCatalog, JobPage

NO_WORKER = (
    "no broker is configured (BATCHWORK_BROKER_URL is memory://), so nothing would ever run this job: "
    "set BATCHWORK_BROKER_URL to a Redis URL and start `batchwork worker`, or use `batchwork run FILE`, "
    "which runs a worker in its own process"
)
# Cancelled items stored per transaction when a producer cancels its own job.
CANCEL_GROUP = 5000
# Items a producer orders by length at a time, in chunks (see length_order).
ORDER_WINDOW_CHUNKS = 8


class ItemResult(NamedTuple):
    """One stored item as a reader gets it back (``Client.results``): a tuple of its index, output, error
    and user id. Inside the worker the store writes and reads ItemRecords (worker/store/values.py)."""

    index: int  # type: ignore[assignment]  # shadows tuple.index on purpose: results are (index, ...)
    output: Any
    error: str | None
    item_id: str | None


class Messages(Protocol):
    """Where a job's messages go, and the record of an ``infer.delay`` job no worker has taken yet."""

    def send(self, call: NewJob, parts: Iterable[Any] | None, *, record_job: bool) -> None:
        """``call``'s items as messages (or its items already encoded, ``Publisher.send``'s parts); with
        ``record_job``, the job's record in the same transaction."""
        ...

    def queued(self, job_id: str) -> dict[str, str] | None:
        """The job's record while only the broker knows it (model, priority, total, created_at)."""
        ...

    def newest_queued(self, before: float | None, count: int) -> list[tuple[str, dict[str, str]]]:
        """Up to ``count`` such records, newest first, accepted before Unix time ``before`` (any: None)."""
        ...


class Jobs:
    """enqueue / delay / record / publish, find / status / results / result_lines / page, cancel."""

    def __init__(
        self, settings: Settings, records: JobRecords | None = None, messages: Messages | None = None
    ) -> None:
        self.settings = settings
        self._records = records
        self._messages = messages

    @property
    def records(self) -> JobRecords:
        """The SQL store; a SQLite database is created (and migrated) on first write, never by a read."""
        if self._records is not None:
            return self._records
        from worker.store.results import ResultStore

        return ResultStore.for_url(self.settings.database_url)

    @cached_property
    def messages(self) -> Messages:
        if self._messages is not None:
            return self._messages
        return InProcessMessages(self.settings) if self.settings.embedded else RedisMessages(self.settings)

    @cached_property
    def catalog(self) -> JobCatalog:
        from worker.store.catalog import JobCatalog

        return JobCatalog(self.records.engine)  # type: ignore[attr-defined]  # the SQL store's

    # -- enqueue ------------------------------------------------------------------------------------

    def enqueue(self, call: NewJob, *, tenant: str = DEFAULT_TENANT, metadata: Any = None) -> str:
        """A checked call's job recorded in SQL, then its messages published; the job id."""
        self.record(call, tenant=tenant, metadata=metadata)
        self.publish(call)
        return call.job_id

    def delay(self, call: NewJob) -> str:
        """``infer.delay``'s path: the job's Redis record and its message in one transaction (no SQL); the
        in-process broker has no records, so there the job is recorded in SQL first, as any other."""
        if self.settings.embedded:
            return self.enqueue(call)
        self.messages.send(call, None, record_job=True)
        return call.job_id

    def record(self, call: NewJob, *, tenant: str = DEFAULT_TENANT, metadata: Any = None) -> bool:
        """Record the job of a checked call in SQL (``call.total`` items), before any of it is published, for
        a producer that publishes it in parts (``batchwork run``, the API's NDJSON); False when it existed.
        InvalidInput for metadata the store could not keep, or a tenant that is no tenant's name."""
        check_json(metadata, "metadata")
        if not isinstance(tenant, str) or not TENANT_PATTERN.fullmatch(tenant):  # as API keys' tenants are
            raise InvalidInput(
                f"tenant {tenant!r:.80}: use 1-64 of a-z, 0-9, '_', '.', '-' (a letter or digit first)"
            )
        spec = JobSpec(call.job_id, call.model, call.priority, call.total)
        return self.records.create_job(spec, create_schema=True, tenant=tenant, metadata=metadata)

    def publish(self, call: NewJob, parts: Iterable[Any] | None = None) -> None:
        """Send the messages of a recorded job: ``call``'s items, or its items already encoded (``parts``).
        A failure part way fails the job, saying why, since the messages already sent still run."""
        self.publish_by(call, lambda: self.messages.send(call, parts, record_job=False))

    def publish_by(self, call: NewJob, send: Callable[[], object]) -> None:
        """As ``publish``, the messages sent by ``send`` (the API's NDJSON: from its checking processes)."""
        try:
            send()
        except Exception as exc:
            self.records.fail_job(call.job_id, f"submit could not publish every message: {exc}")
            raise

    # -- read -----------------------------------------------------------------------------------------

    def find(self, job_id: str, tenants: Collection[str] | None = None) -> JobStatus | None:
        """The job's status, or None for an unknown job (or, given ``tenants``, another tenant's). SQL, then
        the broker's record (jobs of ``infer.delay``, whose tenant is the default one), then SQL again: a
        worker may have moved the job between the two reads."""
        if not is_job_id(job_id):
            return None
        status = self.records.status(job_id, tenants)
        if status is not None or (tenants is not None and DEFAULT_TENANT not in tenants):
            return status
        record = self.messages.queued(job_id)
        if record is not None:
            return queued_status(job_id, record)
        return self.records.status(job_id, tenants)

    def status(self, job_id: str, tenants: Collection[str] | None = None) -> JobStatus:
        """As ``find``; JobNotFound for an unknown job."""
        if not is_job_id(job_id):
            raise JobNotFound(f"no job {job_id!r}: a job id is a UUID like {uuid.UUID(int=0)}")
        status = self.find(job_id, tenants)
        if status is None:
            raise JobNotFound(f"no job {job_id} in {self.records.location()}")
        return status

    def results(self, job_id: str, after: int = -1) -> Iterator[ItemResult]:
        """Stored outcomes in index order (those of index above ``after``); JobNotFound for an unknown job.
        Items still running are not there yet."""
        self.status(job_id)
        return (
            ItemResult(outcome.index, outcome.output, outcome.error, outcome.item_id)
            for outcome in self.records.results(job_id, after)
        )

    def result_lines(self, job_id: str, after: int = -1, limit: int | None = None) -> Iterator[bytes]:
        """Stored outcomes as NDJSON lines (see ResultStore.result_lines), for a job found already."""
        return self.records.result_lines(job_id, after=after, limit=limit)

    def page(
        self,
        tenants: Collection[str],
        *,
        state: JobState | None = None,
        limit: int = 50,
        cursor: str | None = None,
    ) -> JobPage:
        """The tenants' jobs, newest first, ``limit`` at a time (see JobCatalog.page); for the default
        tenant, with the queued jobs only the broker knows, in their place by (created_at, id)."""
        from worker.store.catalog import JobPage, decode_cursor, encode_cursor

        page = self.catalog.page(tenants, state=state, limit=limit, cursor=cursor)
        if DEFAULT_TENANT not in tenants or state not in (None, JobState.QUEUED):
            return page
        after = None if cursor is None else decode_cursor(cursor)
        known = {job.job_id for job in page.jobs}
        queued = [job for job in self._queued_before(after, limit + 1) if job.job_id not in known]
        if not queued:
            return page
        merged = sorted([*page.jobs, *queued], key=lambda job: (job.created_at, job.job_id), reverse=True)
        if page.next_cursor is None and len(merged) <= limit:
            return JobPage(merged, None)
        last = merged[limit - 1]
        return JobPage(merged[:limit], encode_cursor(last.created_at, last.job_id))

    def _queued_before(self, after: tuple[datetime, str] | None, count: int) -> list[JobStatus]:
        """The newest ``count`` jobs only the broker knows, of (created_at, id) below ``after``."""
        # The broker's score is when the record was written, a moment after created_at: a second's slack.
        before = None if after is None else after[0].timestamp() + 1
        found = []
        for job_id, record in self.messages.newest_queued(before, count):
            status = queued_status(job_id, record)
            if after is None or (status.created_at, job_id) < after:
                found.append(status)
        return found

    # -- cancel -------------------------------------------------------------------------------------

    def cancel(
        self,
        job_id: str,
        unfinished: Iterable[tuple[int, str | None]] = (),
        tenants: Collection[str] | None = None,
    ) -> bool:
        """Mark the job cancelled; True unless it had already finished. JobNotFound for an unknown job.

        A job only the broker knows is recorded in SQL as cancelled: the worker that takes its message finds
        it so and stores its items as cancelled. ``unfinished``: items ``(index, user id)`` to store as
        cancelled now, each unless it already has an outcome, for a producer that stops its own job
        (``batchwork run`` on Ctrl-C): the store then holds every item, and a result that arrives later is
        not stored, so it never disagrees with what the producer wrote. InvalidInput for an index that is
        not the job's, or an id that is no storable string.
        """
        status = self.status(job_id, tenants)
        spec = JobSpec(job_id, status.model, status.priority, status.total)
        changed = self.records.cancel(job_id)
        if not changed and status.state == JobState.QUEUED and status.started_at is None:
            changed = self.records.create_job(spec, state=JobState.CANCELLED) or self.records.cancel(job_id)
        if self.status(job_id).state == JobState.CANCELLED:
            self._store_cancelled(spec, unfinished)
        return changed

    def _store_cancelled(self, spec: JobSpec, items: Iterable[tuple[int, str | None]]) -> None:
        group: list[ItemRecord] = []
        for index, item_id in items:  # checked one by one: a run's Ctrl-C may name millions
            if not is_count(index) or index >= spec.total:
                raise InvalidInput(f"unfinished: {index!r:.40} is no item index of job {spec.job_id}")
            if item_id is not None and (not isinstance(item_id, str) or unstorable(item_id) is not None):
                raise InvalidInput(f"unfinished: item {index}'s id {item_id!r:.40} is not a storable string")
            group.append(ItemRecord(spec.job_id, index, item_id, error="cancelled"))
            if len(group) >= CANCEL_GROUP:
                self.records.write_batch(None, group, [spec])
                group = []
        if group:
            self.records.write_batch(None, group, [spec])


def queued_status(job_id: str, record: dict[str, str]) -> JobStatus:
    """The status of a job the broker's record describes: queued, in the default tenant."""
    return JobStatus(
        job_id=job_id,
        model=record.get("model", "?"),
        priority=record.get("priority", "normal"),
        state=JobState.QUEUED,
        total=int(record.get("total", 0)),
        done=0,
        failed=0,
        error=None,
        created_at=datetime.fromisoformat(record["created_at"]),
        started_at=None,
        finished_at=None,
        tenant=DEFAULT_TENANT,
    )


class RedisMessages:
    """Messages to the Redis broker's queues (Publisher), records of ``infer.delay`` jobs (PendingJobs)."""

    def __init__(self, settings: Settings) -> None:
        from worker.broker.keys import Keys
        from worker.broker.producer import PendingJobs, Publisher

        self.settings = settings
        keys = Keys.of(settings)
        self.publisher = Publisher(settings.broker_url, keys, settings.submit_chunk_size)
        self.pending = PendingJobs(settings.broker_url, keys)

    def send(self, call: NewJob, parts: Iterable[Any] | None, *, record_job: bool) -> None:
        if parts is None:
            order = length_order(call, self.settings)
            self.publisher.enqueue(call, task_id=call.job_id, record_job=record_job, order=order)
        else:
            self.publisher.send(call, parts, task_id=call.job_id, record_job=record_job)

    def queued(self, job_id: str) -> dict[str, str] | None:
        return self.pending.get(job_id)

    def newest_queued(self, before: float | None, count: int) -> list[tuple[str, dict[str, str]]]:
        return self.pending.newest(before, count)


class InProcessMessages:
    """The in-memory broker of ``batchwork run``'s in-process worker: no records (jobs are in SQL first)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def send(self, call: NewJob, parts: Iterable[Any] | None, *, record_job: bool) -> None:
        from worker.broker.in_process import IN_PROCESS_WORKER, publish_in_process

        if parts is not None or not IN_PROCESS_WORKER.is_set():
            raise NoWorker(NO_WORKER)
        publish_in_process(call, self.settings)

    def queued(self, job_id: str) -> dict[str, str] | None:
        return None

    def newest_queued(self, before: float | None, count: int) -> list[tuple[str, dict[str, str]]]:
        return []


_DEFAULT: list[Jobs] = []


def default_jobs() -> Jobs:
    """One port per settings object, so its connections are reused from call to call."""
    settings = get_settings()
    if not _DEFAULT or _DEFAULT[0].settings is not settings:
        _DEFAULT[:] = [Jobs(settings)]
    return _DEFAULT[0]


def length_order(call: NewJob, settings: Settings) -> list[int] | None:
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
