"""The jobs port's one rule, without servers: a producer records a job in SQL before any message of it;
``infer.delay``'s job is a broker record sent with its message, moved to SQL by the worker that stores its
first item; every reader finds a job SQL, then broker, then SQL, so a queued job reads the same everywhere."""

from __future__ import annotations

import time
import uuid
from collections.abc import Collection, Iterable
from datetime import UTC, datetime
from typing import Any

import pytest

from tests.support.memory_store import MemoryStore
from worker.calls import NewJob
from worker.errors import BrokerUnavailable, InvalidInput, JobNotFound
from worker.jobs import Jobs
from worker.settings import Settings
from worker.store.catalog import JobPage, decode_cursor, encode_cursor
from worker.store.values import FINISHED_STATES, UNFINISHED_STATES, ItemRecord, JobSpec, JobState

SETTINGS = Settings(broker_url="redis://127.0.0.1:1/0")  # never reached: the broker here is a fake


class MemoryBroker:
    """The broker side of the port in memory: messages as sent, and the records of ``infer.delay`` jobs."""

    def __init__(self, store: MemoryStore) -> None:
        self.store = store
        self.sent: list[tuple[NewJob, bool]] = []
        self.records: dict[str, dict[str, str]] = {}
        self.rows_at_send: list[bool] = []  # was the job in SQL when its message went out
        self.on_read: Any = None  # called before a record is read (a worker moving the job meanwhile)
        self.failing = False

    def send(self, call: NewJob, parts: Iterable[Any] | None, *, record_job: bool) -> None:
        if self.failing:
            raise BrokerUnavailable("cannot reach the broker")
        self.rows_at_send.append(self.store.status(call.job_id) is not None)
        if record_job:
            created = datetime.fromtimestamp(call.created_at or time.time(), UTC).isoformat()
            self.records[call.job_id] = {
                "model": call.model,
                "priority": call.priority,
                "total": str(call.total),
                "created_at": created,
            }
        self.sent.append((call, record_job))

    def queued(self, job_id: str) -> dict[str, str] | None:
        if self.on_read is not None:
            self.on_read()
        return self.records.get(job_id)

    def newest_queued(self, before: float | None, count: int) -> list[tuple[str, dict[str, str]]]:
        def when(record: dict[str, str]) -> float:
            return datetime.fromisoformat(record["created_at"]).timestamp()

        found = [(j, r) for j, r in self.records.items() if before is None or when(r) <= before]
        return sorted(found, key=lambda jr: when(jr[1]), reverse=True)[:count]

    def take_first_item(self, call: NewJob) -> None:
        """What a worker does: store the job's first item (its SQL row made from the message), then drop
        the record."""
        spec = JobSpec(call.job_id, call.model, call.priority, call.total)
        self.store.write_batch(None, [ItemRecord(call.job_id, 0, None, output=[1.0])], [spec])
        self.records.pop(call.job_id, None)


@pytest.fixture
def store() -> MemoryStore:
    return MemoryStore()


@pytest.fixture
def broker(store: MemoryStore) -> MemoryBroker:
    return MemoryBroker(store)


@pytest.fixture
def jobs(store: MemoryStore, broker: MemoryBroker) -> Jobs:
    return Jobs(SETTINGS, store, broker)


def a_call(total: int = 3, created_at: float | None = None) -> NewJob:
    inputs = [f"t{i}" for i in range(total)]
    return NewJob(str(uuid.uuid4()), "noop", inputs, "normal", 0, total, None, created_at)


class MemoryCatalog:
    """JobCatalog.page over the memory store's rows (created_at, id descending, a keyset cursor)."""

    def __init__(self, store: MemoryStore) -> None:
        self.store = store

    def page(
        self, tenants: Collection[str], *, state: Any = None, limit: int = 50, cursor: str | None = None
    ) -> JobPage:
        jobs = [self.store.status(job_id, tenants) for job_id in list(self.store.jobs)]
        found = [j for j in jobs if j is not None and state in (None, j.state)]
        if cursor is not None:
            after = decode_cursor(cursor)
            found = [j for j in found if (j.created_at, j.job_id) < after]
        found.sort(key=lambda j: (j.created_at, j.job_id), reverse=True)
        if len(found) <= limit:
            return JobPage(found, None)
        return JobPage(found[:limit], encode_cursor(found[limit - 1].created_at, found[limit - 1].job_id))


def test_every_state_is_finished_or_unfinished_and_reads_as_its_text() -> None:
    assert set(FINISHED_STATES) | set(UNFINISHED_STATES) == set(JobState)
    assert not set(FINISHED_STATES) & set(UNFINISHED_STATES)
    assert JobState.QUEUED == "queued" and f"{JobState.PARTIAL}" == "partial"


def test_a_producer_records_the_job_in_sql_before_its_message(
    jobs: Jobs, broker: MemoryBroker, store: MemoryStore
) -> None:
    call = a_call()
    assert jobs.enqueue(call, tenant="acme", metadata={"run": 1}) == call.job_id
    assert broker.rows_at_send == [True] and broker.records == {}
    status = jobs.status(call.job_id)
    assert (status.state, status.tenant, status.metadata, status.total) == ("queued", "acme", {"run": 1}, 3)


def test_a_publish_that_fails_fails_the_recorded_job_saying_why(jobs: Jobs, broker: MemoryBroker) -> None:
    call = a_call()
    broker.failing = True
    with pytest.raises(BrokerUnavailable):
        jobs.enqueue(call)
    status = jobs.status(call.job_id)
    assert status.state == JobState.FAILED
    assert status.error == "submit could not publish every message: cannot reach the broker"


def test_a_delayed_job_is_a_broker_record_sent_with_its_message_until_a_worker_stores_an_item(
    jobs: Jobs, broker: MemoryBroker, store: MemoryStore
) -> None:
    call = a_call()
    jobs.delay(call)
    assert broker.sent == [(call, True)] and store.status(call.job_id) is None
    queued = jobs.status(call.job_id)
    assert (queued.state, queued.total, queued.tenant, queued.started_at) == ("queued", 3, "default", None)

    broker.take_first_item(call)

    running = jobs.status(call.job_id)
    assert (running.state, running.done) == (JobState.RUNNING, 1)
    assert [r.output for r in jobs.results(call.job_id)] == [[1.0]]


def test_a_job_moved_to_sql_between_the_two_reads_is_found_in_sql(jobs: Jobs, broker: MemoryBroker) -> None:
    call = a_call()
    jobs.delay(call)
    broker.on_read = lambda: broker.take_first_item(call)  # SQL missed it; the record is gone when read
    assert jobs.status(call.job_id).state == JobState.RUNNING


def test_a_delayed_job_is_the_default_tenants_for_every_reader(jobs: Jobs, broker: MemoryBroker) -> None:
    call = a_call()
    jobs.delay(call)
    assert jobs.find(call.job_id, ["alice"]) is None  # another tenant's key: 404, as for a SQL job
    found = jobs.find(call.job_id, ["ops", "default"])  # an admin key sees the default tenant
    assert found is not None and found.state == JobState.QUEUED
    with pytest.raises(JobNotFound):
        jobs.cancel(call.job_id, tenants=["alice"])


def test_cancelling_a_delayed_job_records_it_cancelled_in_sql(
    jobs: Jobs, broker: MemoryBroker, store: MemoryStore
) -> None:
    call = a_call()
    jobs.delay(call)
    assert jobs.cancel(call.job_id) is True
    assert store.status(call.job_id) is not None
    assert jobs.status(call.job_id).state == JobState.CANCELLED
    assert jobs.cancel(call.job_id) is False  # finished already


def test_a_producer_cancelling_its_own_job_stores_its_unfinished_items(
    jobs: Jobs, broker: MemoryBroker, store: MemoryStore
) -> None:
    call = a_call(total=3)
    jobs.enqueue(call)
    broker.take_first_item(call)
    jobs.cancel(call.job_id, unfinished=[(1, "b"), (2, None)])
    assert [(r.index, r.error) for r in jobs.results(call.job_id)] == [
        (0, None),
        (1, "cancelled"),
        (2, "cancelled"),
    ]


@pytest.mark.parametrize(
    "unfinished",
    [[(3, None)], [(-1, None)], [("1", None)], [(True, None)], [(1, "a\x00")], [(1, 5)]],
)
def test_unfinished_items_that_are_not_the_job_s_are_refused_and_none_is_stored(
    jobs: Jobs, unfinished: list[Any]
) -> None:
    call = a_call(total=3)
    jobs.enqueue(call)
    with pytest.raises(InvalidInput, match="^unfinished: "):
        jobs.cancel(call.job_id, unfinished=unfinished)
    assert list(jobs.results(call.job_id)) == []  # the cancel itself stands: it was asked for


@pytest.mark.parametrize("tenant", ["", "Acme", "a\x00", "x" * 65, 5, "-x"])
def test_a_tenant_that_is_no_tenant_name_is_refused_before_the_job_is_recorded(
    jobs: Jobs, store: MemoryStore, tenant: Any
) -> None:
    call = a_call()
    with pytest.raises(InvalidInput, match="^tenant .*: use 1-64 of a-z"):
        jobs.enqueue(call, tenant=tenant)
    assert store.status(call.job_id) is None


class Untouchable:
    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"{name} was called")


@pytest.mark.parametrize("job_id", ["", "x", "[/x]", str(uuid.uuid4()).upper() + "0"])
def test_a_string_that_is_no_job_id_is_no_job_and_reaches_no_store(job_id: str) -> None:
    jobs = Jobs(SETTINGS, Untouchable(), Untouchable())  # type: ignore[arg-type]
    assert jobs.find(job_id) is None
    with pytest.raises(JobNotFound, match="no job"):
        jobs.status(job_id)


def test_an_unknown_job_is_not_found(jobs: Jobs) -> None:
    with pytest.raises(JobNotFound, match="no job"):
        jobs.status(str(uuid.uuid4()))


def test_embedded_delay_records_the_job_in_sql_first(store: MemoryStore, broker: MemoryBroker) -> None:
    jobs = Jobs(Settings(broker_url="memory://"), store, broker)
    call = a_call()
    jobs.delay(call)
    assert broker.sent == [(call, False)] and broker.rows_at_send == [True]


def test_a_listing_holds_the_queued_jobs_only_the_broker_knows_in_their_place(
    jobs: Jobs, broker: MemoryBroker, store: MemoryStore
) -> None:
    jobs.catalog = MemoryCatalog(store)  # type: ignore[assignment]
    now = time.time()
    made = []
    for age_s in (50, 40, 30, 20, 10):  # oldest first: SQL, Redis, SQL, Redis, SQL
        call = a_call(created_at=now - age_s)
        if len(made) % 2:
            jobs.delay(call)
        else:
            jobs.enqueue(call)
            store.jobs[call.job_id].created_at = datetime.fromtimestamp(now - age_s, UTC)
        made.append(call.job_id)
    pages, cursor = [], None
    while True:
        page = jobs.page(["ops", "default"], limit=2, cursor=cursor)
        pages.append([job.job_id for job in page.jobs])
        if (cursor := page.next_cursor) is None:
            break
    assert pages == [made[:2:-1], made[2:0:-1], made[:1]]
    assert [job.job_id for job in jobs.page(["alice"]).jobs] == []
    assert jobs.page(["default"], state=JobState.RUNNING).jobs == []
    assert [job.job_id for job in jobs.page(["default"], state=JobState.QUEUED).jobs] == made[::-1]
