"""The store thread on real PostgreSQL, with a fake outbox: outcomes the database refuses fail alone, a
message never touches a job that is not its own, and an outage is waited out, not turned into errors."""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import pytest
from sqlalchemy.engine import make_url

from tests.integration.tcp_proxy import TcpProxy
from worker.calls import InferMessage
from worker.runtime.deliveries import Delivery, Holdings, Refusal, ResultsToStore
from worker.runtime.hooks import Hooks
from worker.runtime.hooks.task_events import TaskEvents
from worker.runtime.outbox import Settled
from worker.runtime.store_thread import Storer
from worker.store.results import ResultStore
from worker.store.values import BatchRecord, ItemRecord, JobSpec


class FakeOutbox:
    def __init__(self) -> None:
        self.settled: list[Settled] = []
        self.events: list[str] = []

    def settle(self, settled: Settled) -> None:
        self.settled.append(settled)

    def event(self, event: dict[str, Any]) -> None:
        self.events.append(event["type"])


class FakeMessage:
    def __init__(self, task_id: str, kwargs: dict[str, Any] | None = None) -> None:
        self.headers = {"id": task_id}
        self.properties: dict[str, Any] = {}
        self.delivery_tag = task_id
        self._kwargs = kwargs or {}

    def decode(self) -> Any:
        return (), self._kwargs, {}


def held(job: JobSpec, count: int) -> Delivery:
    delivery = Delivery(FakeMessage(str(uuid.uuid4())), 0.0)
    delivery.call = InferMessage(job.job_id, job.model, ["x"] * count, job.priority, total=job.total)
    delivery.pending = count
    return delivery


def record(size: int) -> BatchRecord:
    from datetime import UTC, datetime

    return BatchRecord("noop", "normal", size, size, size, 1.0, 1.0, datetime.now(UTC), "w@test")


def run(storer: Storer, *work: Any) -> None:
    thread = threading.Thread(target=storer.loop)
    thread.start()
    for each in work:
        storer.work.put(each)
    storer.work.put(None)
    thread.join(60)
    assert not thread.is_alive(), "the store thread wedged"


def test_an_outcome_the_database_refuses_fails_alone_and_every_message_is_acked(
    pg_store: ResultStore,
) -> None:
    job = JobSpec(str(uuid.uuid4()), "noop", "normal", 8)
    delivery = held(job, 8)
    write = ResultsToStore(record(8))
    for index in range(8):
        # results.item_id holds 200 characters: item 5's id is refused by PostgreSQL itself.
        ident = "L" * 300 if index == 5 else f"id-{index}"
        write.add(ItemRecord(job.job_id, index, ident, output=index), delivery)
    outbox = FakeOutbox()
    run(Storer(pg_store, outbox, Holdings()), write)  # type: ignore[arg-type]
    status = pg_store.status(job.job_id)
    assert status is not None and (status.state, status.done, status.failed) == ("partial", 7, 1)
    stored = {r.index: r for r in pg_store.results(job.job_id)}
    assert stored[5].item_id is None and "could not store the output" in (stored[5].error or "")
    assert [stored[i].output for i in range(8) if i != 5] == [0, 1, 2, 3, 4, 6, 7]
    assert [d for settled in outbox.settled for d in settled.deliveries] == [delivery]


def test_two_writers_store_every_item_once_and_ack_every_message_once(pg_store: ResultStore) -> None:
    # PostgreSQL gets two writer threads; a message's items are split over writes that either may store.
    job = JobSpec(str(uuid.uuid4()), "noop", "normal", 2000)
    deliveries = [held(job, 50) for _ in range(40)]
    writes = []
    for start in range(0, 2000, 30):  # 30 items a write: runs that straddle the 50-item messages
        write = ResultsToStore(record(30))
        for index in range(start, min(start + 30, 2000)):
            write.add(ItemRecord(job.job_id, index, None, output=index), deliveries[index // 50])
        writes.append(write)
    outbox = FakeOutbox()
    storer = Storer(pg_store, outbox, Holdings(), Hooks([TaskEvents(outbox)]))  # type: ignore[arg-type]
    assert storer.writers == 2
    run(storer, *writes)
    acked = [d for settled in outbox.settled for d in settled.deliveries]
    assert sorted(map(id, acked)) == sorted(map(id, deliveries))
    assert all(d.pending == 0 and d.failed == 0 for d in deliveries)
    assert outbox.events.count("task-succeeded") == 40
    status = pg_store.status(job.job_id)
    assert status is not None and (status.state, status.done, status.failed) == ("succeeded", 2000, 0)
    assert [r.output for r in pg_store.results(job.job_id)] == list(range(2000))


def test_a_job_id_the_database_cannot_keep_is_let_go_without_wedging(pg_store: ResultStore) -> None:
    bad = JobSpec("J" * 300, "noop", "normal", 1)
    good = JobSpec(str(uuid.uuid4()), "noop", "normal", 1)
    bad_delivery, good_delivery = held(bad, 1), held(good, 1)
    write = ResultsToStore(record(2))
    write.add(ItemRecord(bad.job_id, 0, None, output=1), bad_delivery)
    write.add(ItemRecord(good.job_id, 0, None, output=2), good_delivery)
    outbox = FakeOutbox()
    run(Storer(pg_store, outbox, Holdings()), write)  # type: ignore[arg-type]
    status = pg_store.status(good.job_id)
    assert status is not None and (status.state, status.done) == ("succeeded", 1)
    assert {id(d) for s in outbox.settled for d in s.deliveries} == {id(bad_delivery), id(good_delivery)}


def test_a_message_that_disagrees_with_its_job_writes_nothing_into_it(pg_store: ResultStore) -> None:
    job = JobSpec(str(uuid.uuid4()), "noop", "normal", 3)
    pg_store.create_job(job)
    liar = JobSpec(job.job_id, "noop", "normal", 50)  # a raw message claiming 50 items for this job
    delivery = held(liar, 1)
    write = ResultsToStore(record(1))
    write.add(ItemRecord(job.job_id, 40, None, output="injected"), delivery)
    outbox = FakeOutbox()
    run(Storer(pg_store, outbox, Holdings()), write)  # type: ignore[arg-type]
    status = pg_store.status(job.job_id)
    assert status is not None and (status.state, status.done, status.total) == ("queued", 0, 3)
    assert list(pg_store.results(job.job_id)) == []
    assert [d for s in outbox.settled for d in s.deliveries] == [delivery]  # acked, not retried forever


def test_a_refused_message_never_fails_an_existing_job(pg_store: ResultStore) -> None:
    existing = JobSpec(str(uuid.uuid4()), "noop", "normal", 2)
    pg_store.create_job(existing)
    hostile = Delivery(FakeMessage(str(uuid.uuid4()), {"job_id": existing.job_id, "model": 5}), 0.0)
    fresh_task = str(uuid.uuid4())
    own = Delivery(FakeMessage(fresh_task, {"model": "noop", "inputs": "abc"}), 0.0)
    outbox = FakeOutbox()
    storer = Storer(pg_store, outbox, Holdings(), Hooks([TaskEvents(outbox)]))  # type: ignore[arg-type]
    run(storer, Refusal(hostile, "invalid message"), Refusal(own, "invalid: x"))
    existing_status = pg_store.status(existing.job_id)
    assert existing_status is not None and existing_status.state == "queued"
    own_status = pg_store.status(fresh_task)
    assert own_status is not None and (own_status.state, own_status.error) == ("failed", "invalid: x")
    assert outbox.events.count("task-failed") == 2


def test_a_refusal_whose_text_the_database_refuses_is_still_acknowledged(pg_store: ResultStore) -> None:
    # PostgreSQL keeps no NUL character; a message may carry one in any field its refusal repeats.
    task_id = str(uuid.uuid4())
    nul = Delivery(FakeMessage(task_id, {"model": "no\x00de", "inputs": 3}), 0.0)
    outbox = FakeOutbox()
    run(Storer(pg_store, outbox, Holdings()), Refusal(nul, "invalid model 'no\x00de'"))  # type: ignore[arg-type]
    status = pg_store.status(task_id)
    assert status is not None and status.state == "failed" and "no" in (status.error or "")
    assert [d for s in outbox.settled for d in s.deliveries] == [nul]


@pytest.mark.slow
def test_an_outage_is_waited_out_and_then_everything_is_stored(pg_url: str, pg_store: ResultStore) -> None:
    url = make_url(pg_url)
    proxy = TcpProxy(url.host or "127.0.0.1", url.port or 5432)
    store = ResultStore.from_url(url.set(port=proxy.port).render_as_string(hide_password=False))
    job = JobSpec(str(uuid.uuid4()), "noop", "normal", 4)
    delivery = held(job, 4)
    write = ResultsToStore(record(4))
    for index in range(4):
        write.add(ItemRecord(job.job_id, index, None, output=index), delivery)
    storer = Storer(store, FakeOutbox(), Holdings())  # type: ignore[arg-type]
    try:
        proxy.cut()
        thread = threading.Thread(target=storer.loop)
        thread.start()
        storer.work.put(write)
        deadline = time.monotonic() + 30
        while storer.stalled_s() < 1.0:
            assert time.monotonic() < deadline, "the outage was never noticed"
            time.sleep(0.05)
        assert pg_store.status(job.job_id) is None  # nothing turned into errors meanwhile
        proxy.restore()
        storer.work.put(None)
        thread.join(60)
    finally:
        proxy.close()
        store.close()
    assert storer.stalled_s() == 0.0
    status = pg_store.status(job.job_id)
    assert status is not None and (status.state, status.done, status.failed) == ("succeeded", 4, 0)


def test_a_stopping_storer_gives_up_on_a_dead_database(pg_url: str) -> None:
    url = make_url(pg_url)
    proxy = TcpProxy(url.host or "127.0.0.1", url.port or 5432)
    store = ResultStore.from_url(url.set(port=proxy.port).render_as_string(hide_password=False))
    job = JobSpec(str(uuid.uuid4()), "noop", "normal", 1)
    write = ResultsToStore(record(1))
    write.add(ItemRecord(job.job_id, 0, None, output=0), held(job, 1))
    outbox = FakeOutbox()
    storer = Storer(store, outbox, Holdings())  # type: ignore[arg-type]
    try:
        proxy.cut()
        thread = threading.Thread(target=storer.loop)
        thread.start()
        storer.work.put(write)
        deadline = time.monotonic() + 30
        while storer.stalled_s() == 0.0:
            assert time.monotonic() < deadline, "the outage was never noticed"
            time.sleep(0.05)
        storer.stop()
        thread.join(10)
        assert not thread.is_alive(), "a dead database held the store thread at shutdown"
    finally:
        proxy.close()
        store.close()
    assert outbox.settled == []  # nothing stored, nothing acknowledged: the messages go back
