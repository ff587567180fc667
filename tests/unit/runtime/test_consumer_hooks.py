"""What runs on the consumer's thread, with fakes for the channel: the outbox's acks and events, lease
renewal, the fetch throttle, and the holdings they read."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery

from worker.calls import InferMessage
from worker.runtime.deliveries import Delivery, Holdings
from worker.runtime.outbox import (
    HOLD_S,
    IDLE_TICK_S,
    STORE_BACKLOG,
    TICK_S,
    FetchThrottle,
    LeaseRenewal,
    Outbox,
    Settled,
)

QUEUES = {"q.normal": "normal", "q.bulk": "bulk"}


@dataclass
class FakeMessage:
    delivery_tag: str
    headers: dict[str, Any] = field(default_factory=dict)
    properties: dict[str, Any] = field(default_factory=dict)
    acked: bool = False

    def decode(self) -> Any:
        return (), {}, {}

    def ack_log_error(self, logger: Any, errors: Any) -> None:
        self.acked = True


class FakeQoS:
    def __init__(self) -> None:
        self.calls: list[dict[str, list[str]]] = []
        self.held = False

    def holding(self) -> bool:
        return self.held

    def ack_many(self, tags: list[str], lost_ids: list[str], jobs: list[str]) -> None:
        self.calls.append({"tags": list(tags), "lost_ids": list(lost_ids), "jobs": list(jobs)})


class FakeChannel:
    def __init__(self) -> None:
        self.qos = FakeQoS()
        self.renewed: list[list[str]] = []

    def renew_leases(self, tags: list[str]) -> None:
        self.renewed.append(tags)


class FakeTimer:
    def __init__(self, delay: float, callback: Any) -> None:
        self.delay, self.callback, self.cancelled = delay, callback, False

    def cancel(self) -> None:
        self.cancelled = True


class FakeHub:
    def __init__(self) -> None:
        self.timers: list[FakeTimer] = []
        self.soon: list[Any] = []

    def call_later(self, delay: float, callback: Any) -> FakeTimer:
        self.timers.append(FakeTimer(delay, callback))
        return self.timers[-1]

    def call_soon(self, callback: Any) -> None:
        self.soon.append(callback)

    def fire(self) -> float:
        """Run the one pending timer; the delay of the next."""
        pending = [timer for timer in self.timers if not timer.cancelled]
        assert len(pending) == 1
        self.timers.remove(pending[0])
        pending[0].callback()
        return self.timers[-1].delay


class RecordingProducer:
    """Stands in for the event dispatcher's kombu producer: records what would be published."""

    def __init__(self) -> None:
        self.published: list[tuple[list[dict[str, Any]], str]] = []

    def publish(self, body: Any, routing_key: str, **_: Any) -> None:
        self.published.append((list(body), routing_key))


@contextmanager
def event_dispatcher() -> Iterator[tuple[Any, RecordingProducer]]:
    """Celery's own task event dispatcher, as a worker has it (task events buffered), publishing nowhere."""
    app = Celery("outbox", broker="memory://", set_as_current=False)
    with app.connection_for_write() as connection:
        dispatcher = app.events.Dispatcher(connection, hostname="w@test", enabled=True, buffer_group=["task"])
        producer = dispatcher.producer = RecordingProducer()
        yield dispatcher, producer


def delivery(tag: str, lost: int = 0, queue: str = "q.normal") -> Delivery:
    properties = {"batchwork_lost": lost, "batchwork_queue": queue}
    return Delivery(FakeMessage(tag, {"id": f"task-{tag}"}, properties), 0.0)


def call(priority: str, items: int, job: str = "j") -> InferMessage:
    return InferMessage(job, "noop", ["x"] * items, priority, total=items)


def test_the_outbox_acks_everything_settled_since_the_last_tick_in_one_call() -> None:
    outbox, channel = Outbox(), FakeChannel()
    with event_dispatcher() as (dispatcher, producer):
        outbox.attach(FakeHub(), channel, lambda: dispatcher)
        first, second, lost = delivery("1"), delivery("2"), delivery("3", lost=2)
        outbox.settle(Settled([first, second], new_jobs=["job-a"]))
        outbox.settle(Settled([lost]))
        for task in ("task-1", "task-2"):
            outbox.event({"type": "task-succeeded", "uuid": task, "timestamp": 1.0, "runtime": 0.1})
        assert channel.qos.calls == []  # nothing before the tick: the channel is the consumer thread's
        outbox.tick()
        assert channel.qos.calls == [{"tags": ["1", "2", "3"], "lost_ids": ["task-3"], "jobs": ["job-a"]}]
        [(events, routing_key)] = producer.published  # a tick's events leave in one message
        assert routing_key == "task.multi"
        assert [(e["type"], e["uuid"], e["runtime"], e["hostname"]) for e in events] == [
            ("task-succeeded", "task-1", 0.1, "w@test"),
            ("task-succeeded", "task-2", 0.1, "w@test"),
        ]
        assert events[0]["clock"] < events[1]["clock"]  # the worker's Lamport clock, as send() forwards it
        outbox.tick()
        assert len(channel.qos.calls) == 1  # nothing is acked twice
        assert len(producer.published) == 1


def test_the_outbox_ticks_often_only_while_messages_are_held_or_work_waits() -> None:
    outbox, channel, hub = Outbox(), FakeChannel(), FakeHub()
    outbox.attach(hub, channel, lambda: None)
    assert hub.fire() == IDLE_TICK_S  # nothing held, nothing waiting
    channel.qos.held = True  # a fetch delivered messages: their acks come soon
    assert hub.fire() == TICK_S
    channel.qos.held = False
    assert hub.fire() == IDLE_TICK_S
    outbox.settle(Settled([delivery("1")]))  # from another thread, while the tick is far: woken at once
    assert len(hub.soon) == 1
    outbox.event({"type": "task-succeeded", "uuid": "task-1", "timestamp": 1.0})
    assert len(hub.soon) == 1  # one wake-up is enough
    hub.soon.pop()()
    assert channel.qos.calls[0]["tags"] == ["1"]
    assert [timer.delay for timer in hub.timers if not timer.cancelled] == [IDLE_TICK_S]


def test_without_an_event_loop_the_outbox_acks_at_once() -> None:
    outbox = Outbox()
    outbox.attach(None, object(), lambda: None)  # the in-memory broker: plain message.ack
    held = delivery("1")
    outbox.settle(Settled([held]))
    assert held.message.acked  # type: ignore[attr-defined]


def test_a_failing_hook_does_not_stop_the_tick() -> None:
    outbox, channel = Outbox(), FakeChannel()
    outbox.attach(FakeHub(), channel, lambda: None)
    ran = []
    outbox.on_tick += [lambda: 1 / 0, lambda: ran.append(True)]
    outbox.settle(Settled([delivery("1")]))
    outbox.tick()
    assert ran == [True] and channel.qos.calls


def test_leases_of_every_held_message_are_renewed_in_one_call(monkeypatch: pytest.MonkeyPatch) -> None:
    holdings, channel, now = Holdings(), FakeChannel(), [100.0]
    monkeypatch.setattr("worker.runtime.outbox.time.monotonic", lambda: now[0])
    held = [delivery(str(i)) for i in range(5)]
    for each in held:
        holdings.received(each)
    renew = LeaseRenewal(channel, holdings, every_s=7.5, stalled_s=lambda: 0.0, limit_s=30)
    renew()
    assert channel.renewed == []  # not due yet
    now[0] += 7.5
    renew()
    assert [sorted(tags) for tags in channel.renewed] == [["0", "1", "2", "3", "4"]]
    holdings.acknowledged(held[:4])
    now[0] += 7.5
    renew()
    assert channel.renewed[-1] == ["4"]


def test_a_worker_whose_store_is_stalled_stops_renewing(monkeypatch: pytest.MonkeyPatch) -> None:
    holdings, channel, now, stalled = Holdings(), FakeChannel(), [0.0], [31.0]
    monkeypatch.setattr("worker.runtime.outbox.time.monotonic", lambda: now[0])
    holdings.received(delivery("1"))
    renew = LeaseRenewal(channel, holdings, every_s=1, stalled_s=lambda: stalled[0], limit_s=30)
    now[0] += 1
    renew()
    assert channel.renewed == []  # its messages go to a worker that can store them
    stalled[0], now[0] = 0.0, now[0] + 1
    renew()
    assert channel.renewed == [["1"]]


def ran(holdings: Holdings, priority: str, count: int) -> None:
    """``count`` items of ``priority`` have run: handed to the store thread, as Storer.put does."""
    holdings.handed([(SimpleNamespace(job=call(priority, count)), count)])  # type: ignore[list-item]


def test_holdings_count_items_by_priority_and_job() -> None:
    holdings = Holdings()
    holdings.hold(call("bulk", 50, "a"), 50)
    holdings.hold(call("bulk", 20, "b"), 20)
    ran(holdings, "bulk", 50)
    assert holdings.items("bulk") == 70 and holdings.waiting("bulk") == 20 and holdings.handed_items() == 50
    holdings.hold(call("bulk", 50, "a"), -50)
    assert holdings.items("bulk") == 20 and holdings.jobs() == ["b"]
    assert holdings.message_items("bulk") == 20 and holdings.message_items("high") is None


def throttle(holdings: Holdings, limit: int = 1000, reserve: int = 8, stalled: float = 0.0) -> FetchThrottle:
    return FetchThrottle(holdings, limit, QUEUES, reserve, lambda: stalled)


def test_the_throttle_never_holds_back_high() -> None:
    holdings = Holdings()
    holdings.hold(call("bulk", 5000), 5000)
    plan = throttle(holdings)(["q.high", "q.normal", "q.bulk"], 64)
    assert plan == [("q.high", 64), ("q.normal", 1), ("q.bulk", 0)]


def test_the_throttle_takes_as_many_messages_as_fit_under_the_item_bound() -> None:
    holdings = Holdings()
    holdings.hold(call("normal", 100), 100)  # messages of 100 items; 900 more fit
    assert throttle(holdings)(["q.normal"], 256) == [("q.normal", 9)]
    assert throttle(holdings)(["q.normal"], 12) == [("q.normal", 4)]  # 8 prefetch slots stay for high


def test_messages_fetched_but_not_yet_read_count_as_one_message_each() -> None:
    # The consumer asks again within milliseconds, before the prepare thread has read what it fetched:
    # those messages must count, or a worker takes several times its limit (the chaos test's fresh workers).
    holdings = Holdings()
    gate = throttle(holdings, limit=200)
    first = delivery("1")
    holdings.received(first)
    assert gate(["q.normal"], 64) == [("q.normal", 0)]  # its size is unknown until it is read
    holdings.hold(call("normal", 50), 50)
    holdings.read([first])
    assert gate(["q.normal"], 64) == [("q.normal", 3)]  # 150 more fit: three messages of 50
    more = [delivery(tag) for tag in "234"]
    for each in more:
        holdings.received(each)
    assert gate(["q.normal"], 64) == [("q.normal", 0)]  # 50 held and three unread of 50: the limit
    holdings.hold(call("normal", 50), 50)
    holdings.read(more[:1])
    assert holdings.unread("q.normal") == 2 and gate(["q.normal"], 64) == [("q.normal", 0)]


def test_unread_messages_of_one_queue_never_hold_back_another() -> None:
    # A stream of normal messages always has some unread; bulk, counted apart, still gets its share.
    holdings = Holdings()
    gate = throttle(holdings, limit=1000)
    holdings.hold(call("bulk", 100), 100)
    for tag in range(500):
        holdings.received(delivery(str(tag), queue="q.normal"))
    assert gate(["q.normal", "q.bulk"], 2000) == [("q.normal", 0), ("q.bulk", 9)]


def test_the_throttle_pauses_at_the_bound_and_resumes_below_half() -> None:
    holdings = Holdings()
    gate = throttle(holdings)
    holdings.hold(call("bulk", 1000), 1000)
    assert gate(["q.bulk"], 100) == [("q.bulk", 0)]
    ran(holdings, "bulk", 400)
    assert gate(["q.bulk"], 100) == [("q.bulk", 0)]  # 600 waiting: still above half
    ran(holdings, "bulk", 200)
    assert gate(["q.bulk"], 100) == [("q.bulk", 1)]  # 400 waiting: resumed (one 1000-item message fits)


def test_items_that_ran_count_against_the_store_backlog_not_the_limit() -> None:
    holdings = Holdings()
    gate = throttle(holdings)  # limit 1000
    holdings.hold(call("bulk", 500), 500)
    ran(holdings, "bulk", 500)
    assert gate(["q.bulk"], 100) == [("q.bulk", 2)]  # nothing waits: two 500-item messages fit the limit
    for _ in range(2 * STORE_BACKLOG - 1):
        holdings.hold(call("bulk", 500), 500)
        ran(holdings, "bulk", 500)
    assert gate(["q.bulk"], 100) == [("q.bulk", 0)]  # the store owes 4,000 items: the backlog's bound
    holdings.hold(call("bulk", 500), -2500)
    assert gate(["q.bulk"], 100) == [("q.bulk", 2)]  # 1,500 owed: below half the bound again


def test_nothing_is_fetched_while_the_store_is_stalled() -> None:
    assert throttle(Holdings(), stalled=3.0)(["q.high", "q.bulk"], 64) == []


def test_the_throttle_holds_a_few_batches_of_the_loaded_models_not_the_whole_bound() -> None:
    # Four workers, one burst of single-item messages: each should take what it will run soon (the goal),
    # not up to the bound, or the first to fetch keeps most of the burst while the others idle.
    holdings = Holdings()
    holdings.hold(call("normal", 1), 1)
    gate = FetchThrottle(holdings, 4096, QUEUES, 8, lambda: 0.0, hold_goal=lambda: 256)
    assert gate(["q.normal"], 1024) == [("q.normal", 255)]
    capped = FetchThrottle(holdings, 100, QUEUES, 8, lambda: 0.0, hold_goal=lambda: 256)
    assert capped(["q.normal"], 1024) == [("q.normal", 99)]  # max_held_items still bounds the goal


def test_the_limit_follows_the_rate_at_which_the_worker_stores_items() -> None:
    # A worker that stores items quickly holds HOLD_S of them, not just a few batches: holding four batches
    # of 1,024 noop items it ran out of work between fetches (a 200,000-item submit at 102-116k items/s; at
    # 0.1 s of its rate, 260-308k).
    holdings, now = Holdings(), [100.0]
    holdings.hold(call("normal", 100), 100)
    gate = FetchThrottle(
        holdings, 100_000, QUEUES, 8, lambda: 0.0, hold_goal=lambda: 1000, clock=lambda: now[0]
    )
    assert gate(["q.normal"], 10_000) == [("q.normal", 9)]  # the goal until a rate is known
    now[0] += 0.5
    for _ in range(1000):  # 100,000 items run and stored in 0.5 s, in messages of 100: hold 0.1 s of them
        holdings.hold(call("normal", 100), 100)
        ran(holdings, "normal", 100)
        holdings.hold(call("normal", 100), -100)
    assert gate(["q.normal"], 10_000) == [("q.normal", int(200_000 * HOLD_S) // 100 - 1)]
    now[0] += 0.5  # nothing ran since: back to the goal
    assert gate(["q.normal"], 10_000) == [("q.normal", 9)]
