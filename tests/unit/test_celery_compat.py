"""One contract test per private seam of worker/celery_compat.py: each fails, naming the seam and the
installed Celery or kombu version, when the private thing it relies on is gone or behaves differently.

The seams were read against the versions pinned in pyproject.toml (CHECKED_AGAINST); a new pin fails the
first test until someone has read worker/celery_compat.py against the new version. No services:
kombu's Redis classes are built without a server, Celery publishes to its in-memory broker.
"""

from __future__ import annotations

import base64
import inspect
import socket
import time
import tomllib
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.metadata import version
from pathlib import Path
from typing import Any

import orjson
import pytest
from celery import Celery, Task, states
from celery.result import AsyncResult
from kombu import Connection
from kombu.asynchronous import Hub
from kombu.message import Message
from kombu.transport import redis as kombu_redis

from worker.celery_compat import (
    AFTER_TASKS_AND_EVENTS,
    CancellingResult,
    FanoutPoller,
    HeldQoS,
    ReadOnlyBackend,
    deliver_directly,
    mark_acked,
    meta,
    poll_again_after,
    publish_plainly,
    publish_task_events,
    task_events_wanted,
    task_message,
)

ROOT = Path(__file__).resolve().parents[2]
# The versions each seam below was read against. A new pin in pyproject.toml: re-read worker/celery_compat.py
# against it, run these tests, then move these.
CHECKED_AGAINST = {"celery": "5.6.3", "kombu": "5.7.0"}


def pinned(framework: str) -> str:
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for requirement in dependencies:
        name, _, pin = requirement.partition("==")
        if name.split("[")[0] == framework:
            return pin
    raise LookupError(f"pyproject.toml pins no {framework}")


@contextmanager
def seam(section: str, framework: str, relies_on: str) -> Iterator[None]:
    """Turn any failure inside into one line naming the seam, what it relies on and the versions; the seam's
    section in worker/celery_compat.py has the same name."""
    try:
        yield
    except Exception as exc:  # an assertion, a missing attribute, a changed signature: all mean the same
        pytest.fail(
            f"celery_compat seam {section!r} relies on {relies_on} of {framework} (read against "
            f"{CHECKED_AGAINST[framework]}, pinned {pinned(framework)}, installed {version(framework)}), "
            f"and that changed: {type(exc).__name__}: {exc}. Read its section in "
            f"worker/celery_compat.py.",
            pytrace=False,
        )


def source(function: Any) -> str:
    return inspect.getsource(function)


@pytest.mark.parametrize("framework", sorted(CHECKED_AGAINST))
def test_the_seams_were_read_against_the_pinned_versions(framework: str) -> None:
    assert pinned(framework) == CHECKED_AGAINST[framework], (
        f"pyproject.toml now pins {framework} {pinned(framework)}; the private seams in "
        f"worker/celery_compat.py were read against {CHECKED_AGAINST[framework]}: re-read it "
        f"against the new version, run tests/unit/test_celery_compat.py, then update "
        f"CHECKED_AGAINST"
    )


# -- kombu: the Redis transport -------------------------------------------------------------------------


def test_kombu_redis_transport_brpop_is_started_only_through_the_two_methods_we_silence() -> None:
    with seam("the Redis transport", "kombu", "MultiChannelPoller._register_BRPOP / Channel._brpop_start"):
        assert callable(kombu_redis.Channel._brpop_start)
        assert "self._register_BRPOP(channel)" in source(kombu_redis.MultiChannelPoller.on_poll_start)
        assert "channel._brpop_start()" in source(kombu_redis.MultiChannelPoller._register_BRPOP)
        assert "_brpop_start" not in source(kombu_redis.MultiChannelPoller.on_poll_start)


def test_kombu_redis_transport_every_client_comes_from_create_client() -> None:
    with seam("the Redis transport", "kombu", "Channel._create_client(asynchronous=...)"):
        parameters = inspect.signature(kombu_redis.Channel._create_client).parameters
        assert list(parameters) == ["self", "asynchronous"]
        assert "self._create_client()" in source(kombu_redis.Channel.conn_or_acquire)
        assert "self._create_client(asynchronous=True)" in source(kombu_redis.Channel)  # .client


def test_kombu_redis_transport_poller_channels_cycle_and_deliver() -> None:
    with seam(
        "the Redis transport", "kombu", "MultiChannelPoller._channels, Transport.cycle, Transport._deliver"
    ):
        poller = FanoutPoller()
        channel = object()
        poller.add(channel)
        assert poller.served_channels() == [channel]
        poller.discard(channel)
        assert poller.served_channels() == []
        poller.close()
        connection = Connection("redis://127.0.0.1:1/0", transport="worker.broker.transport:Transport")
        transport = connection.transport  # no server: nothing connects until a channel is made
        assert type(transport.cycle).__name__ == "Poller"
        assert "self.cycle" in source(kombu_redis.Transport.register_with_event_loop)
        got: list[Any] = []
        transport._callbacks["batchwork.normal"] = got.append
        transport._deliver({"body": "x"}, "batchwork.normal")
        assert got == [{"body": "x"}]


class _NoRestore:
    """A channel as far as a QoS's own bookkeeping (and its finalizer at exit) reads one."""

    do_restore = False


def test_kombu_redis_transport_qos_bookkeeping_in_memory() -> None:
    with seam("the Redis transport", "kombu", "virtual QoS.append, QoS._delivered/_dirty, QoS._flush"):
        qos = HeldQoS(_NoRestore(), prefetch_count=10)
        assert not qos.holding()
        for tag in ("t1", "t2", "t3"):
            qos.hold_in_memory(f"message {tag}", tag)
        qos.forget_in_memory(["t1"])
        assert qos.holding()
        assert qos.can_consume_max_estimate() == 8
        assert qos.take_all_held() == ["t2", "t3"]
        assert qos.can_consume_max_estimate() == 10
        assert not qos.holding()
        qos.hold_in_memory("message t4", "t4")
        qos.forget_in_memory(["t4", "t5"])  # acked (t5 was never held: nothing to forget)
        assert len(qos._delivered) == 0 and not qos.holding()
        qos.hold_in_memory("message t6", "t6")
        qos._dirty.add("t6")  # kombu's own ack (a reject through the virtual QoS) still counts as forgotten
        assert not qos.holding() and qos.can_consume_max_estimate() == 10
        qos.hold_in_memory("message t7", "t7")  # append flushes what kombu marked
        assert list(qos._delivered) == ["t7"] and qos.holding()
        assert "self._delivered" in source(kombu_redis.QoS.restore_unacked)  # what we replace reads the same


# -- kombu: the event loop ------------------------------------------------------------------------------


def test_kombu_hub_a_busy_turn_sleeps_a_second_unless_patched() -> None:
    with seam(
        "the event loop", "kombu", "Hub.fire_timers(min_delay=1, max_timers=10) read by Hub.create_loop"
    ):
        parameters = inspect.signature(Hub.fire_timers).parameters
        assert parameters["min_delay"].default == 1 and parameters["max_timers"].default == 10
        assert "fire_timers = self.fire_timers" in source(Hub.create_loop)
        for patched, most_s in ((False, 1.0), (True, 0.01)):
            hub = Hub()
            try:
                if patched:
                    poll_again_after(hub, 0.001)
                    poll_again_after(hub, 0.001)  # a reconnect: patched once only
                for _ in range(12):
                    hub.call_later(0, lambda: None)
                delay = hub.fire_timers()
                assert delay <= most_s and (patched or delay == 1), (patched, delay)
            finally:
                hub.close()


# -- kombu: messages ------------------------------------------------------------------------------------


class _Channel:
    no_ack_consumers = None
    acks: list[Any] = []

    def basic_ack(self, delivery_tag: Any, multiple: bool = False) -> None:
        self.acks.append(delivery_tag)


def test_kombu_messages_marked_acked_are_never_acked_again() -> None:
    with seam("messages", "kombu", "Message._state ('ACK', read by Message.acknowledged)"):
        acked = Message(body=b"{}", delivery_tag="t1", channel=_Channel())
        acked.ack()
        assert acked._state == "ACK" and acked.acknowledged  # what Message.ack itself writes
        marked = Message(body=b"{}", delivery_tag="t2", channel=_Channel())
        assert not marked.acknowledged
        mark_acked(marked)
        assert marked.acknowledged
        with pytest.raises(marked.MessageStateError):
            marked.ack()
        assert _Channel.acks == ["t1"]


# -- kombu: serializers; celery: task events ------------------------------------------------------------


def test_kombu_serializer_and_celery_task_events_in_bulk() -> None:
    from kombu.serialization import dumps, loads, registry

    from worker.runtime.hooks.task_events import EVENT_SERIALIZER  # registers it

    with seam("serializers", "kombu", "serialization registry.type_to_name"):
        content_type, encoding, data = dumps([{"type": "task-received"}], serializer=EVENT_SERIALIZER)
        assert (content_type, encoding) == ("application/json", "utf-8")
        assert registry.type_to_name["application/json"] == "json"  # replies and reads stay kombu's
        assert loads(data, content_type, encoding) == [{"type": "task-received"}]

    app = Celery("contract", broker="memory://", set_as_current=False)
    relies_on = "EventDispatcher._publish of a 'task.multi' list, .groups, .mutex, .producer, .serializer"
    with seam("task events", "celery", relies_on), app.connection_for_write() as connection:
        published: list[tuple[Any, str, str]] = []
        dispatcher = app.events.Dispatcher(connection, enabled=True, buffer_group=["task"], buffer_limit=2)

        class Producer:
            def publish(self, body: Any, routing_key: str, serializer: str, **_: Any) -> None:
                published.append((list(body), routing_key, serializer))  # Celery empties its list after

        dispatcher.producer = Producer()
        # What Celery's own send buffers and publishes, for comparison.
        dispatcher.send("task-received", uuid="a", name="n", args="()", kwargs="{}", retries=0)
        dispatcher.send("task-started", uuid="a")
        [(celerys, routing_key, _)] = published
        assert routing_key == "task.multi"
        ours = [{"type": "task-started", "uuid": "b", "timestamp": time.time()}]
        ours[0].update(
            hostname=dispatcher.hostname, utcoffset=0, pid=dispatcher.pid, clock=dispatcher.clock.forward()
        )
        assert set(ours[0]) == set(celerys[1])  # the keys a task-started event has
        publish_task_events(dispatcher, ours, EVENT_SERIALIZER)
        assert published[-1] == (ours, "task.multi", EVENT_SERIALIZER)
        # A publish that fails leaves its events in the outbound buffer; the next publish tries them once.
        dispatcher.producer = None  # publishing now raises, as with the broker away
        publish_task_events(dispatcher, ours, EVENT_SERIALIZER)
        assert [event for event, _, _ in dispatcher._outbound_buffer] == [ours]
        dispatcher.producer = Producer()
        publish_task_events(dispatcher, ours, EVENT_SERIALIZER)
        assert published[-2:] == [(ours, "task.multi", EVENT_SERIALIZER)] * 2
        assert not dispatcher._outbound_buffer
        assert task_events_wanted(dispatcher)
        assert not task_events_wanted(app.events.Dispatcher(connection, enabled=True, groups=["worker"]))
        assert not task_events_wanted(app.events.Dispatcher(connection, enabled=False))
        dispatcher.close()


# -- celery: the task message, publishing plainly -------------------------------------------------------


class _Refusing(Task):
    def apply_async(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the task's own apply_async ran")


def _celery_message(queue: str, task_id: str, kwargs: dict[str, Any], summary: str) -> dict[str, Any]:
    """What Celery's own publish puts on ``queue`` (its in-memory broker keeps kombu's envelope as is)."""
    app = Celery("contract", broker="memory://", set_as_current=False)
    app.conf.update(task_serializer="json", accept_content=["json"], task_ignore_result=True)

    @app.task(base=_Refusing, name="batchwork.contract", bind=True)
    def contract(self: Task, **_: Any) -> None: ...

    with seam("publishing plainly", "celery", "Task.apply_async called unbound past a subclass's own"):
        publish_plainly(contract, kwargs, task_id=task_id, queue=queue, argsrepr="()", kwargsrepr=summary)
    with app.connection_for_read() as connection:
        raw = connection.default_channel._get(queue)
    assert isinstance(raw, dict)
    return raw


def test_celery_task_message_our_message_is_the_one_celery_writes() -> None:
    queue, task_id = f"contract-{uuid.uuid4()}", str(uuid.uuid4())
    kwargs = {"model": "noop", "inputs": ["a", "b"], "offset": 0}
    summary = "{'model': 'noop', 'job_id': 'j'}"
    celery = _celery_message(queue, task_id, kwargs, summary)
    ours = orjson.loads(
        task_message(
            "batchwork.contract", task_id, queue, orjson.dumps(kwargs), kwargsrepr=summary, origin="o"
        )
    )
    with seam(
        "the task message",
        "celery",
        "message protocol 2 (headers, [args, kwargs, embed]) in kombu's envelope",
    ):
        assert set(ours) == set(celery)
        assert set(ours["headers"]) == set(celery["headers"]), "headers Celery writes changed"
        # apply_async passes its argsrepr/kwargsrepr options on to the publish too, as properties.
        assert set(ours["properties"]) == set(celery["properties"]) - {"argsrepr", "kwargsrepr"}
        assert ours["properties"]["delivery_info"] == celery["properties"]["delivery_info"]
        same = {"lang", "task", "id", "root_id", "parent_id", "retries", "timelimit", "eta", "expires"}
        same |= {"group", "group_index", "shadow", "argsrepr", "kwargsrepr", "ignore_result"}
        assert {k: ours["headers"][k] for k in same} == {k: celery["headers"][k] for k in same}
        for key in ("content-type", "content-encoding"):
            assert ours[key] == celery[key]
        assert celery["properties"]["body_encoding"] == ours["properties"]["body_encoding"] == "base64"
        body = orjson.loads(base64.b64decode(ours["body"]))
        assert body == orjson.loads(base64.b64decode(celery["body"]))
        assert body[:2] == [[], kwargs]


# -- celery: the consumer -------------------------------------------------------------------------------


class _Consumer:
    """What Celery's ``Consumer.create_task_handler`` reads of its consumer, recording what it is asked."""

    def __init__(self) -> None:
        self.strategies: dict[str, Any] = {}
        self.unknown: list[Any] = []
        self.on_unknown_message = self.on_unknown_task = self.on_invalid_task = self._unknown
        self.on_task_message: set[Any] = set()
        self.call_soon = None

    def _unknown(self, _payload: Any, message: Any, *_: Any) -> None:
        self.unknown.append(message)

    def create_task_handler(self) -> Any:
        from celery.worker.consumer import Consumer

        return Consumer.create_task_handler(self)


def _message(headers: Any) -> Message:
    return Message(body=b"[[], {}, {}]", headers=headers, content_type="application/json")


def test_celery_consumer_steps_handler_and_attributes() -> None:
    from celery.utils.imports import symbol_by_name
    from celery.worker import loops
    from celery.worker.consumer import Consumer
    from celery.worker.consumer.events import Events
    from celery.worker.consumer.tasks import Tasks

    with seam(
        "the consumer", "celery", "the consumer's bootsteps by path, create_task_handler, consumer attributes"
    ):
        for path in AFTER_TASKS_AND_EVENTS:
            assert path in Consumer.Blueprint.default_steps
            assert symbol_by_name(path) in (Events, Tasks)
        # Both loops ask the consumer for its handler when they start and give it every raw message.
        for loop in (loops.asynloop, loops.synloop):
            assert "= obj.create_task_handler()" in source(loop)
            assert "consumer.on_message = on_task_received" in source(loop)
        # Celery's handler takes the message alone; one of a task it does not know is refused as unknown.
        consumer = _Consumer()
        delivered: list[Any] = []
        deliver_directly(consumer, "batchwork.contract", delivered.append)
        deliver_directly(consumer, "batchwork.contract", delivered.append)  # a restart: the same, once
        handler = consumer.create_task_handler()
        ours, theirs, headless = (
            _message({"task": "batchwork.contract"}),
            _message({"task": "someone.else"}),
            _message(None),
        )
        for message in (ours, theirs, headless):
            handler(message)
        assert delivered == [ours]
        assert consumer.unknown == [theirs, headless]
        assert "c.task_consumer = " in source(Tasks.start)
        assert "c.event_dispatcher = " in source(Events.start)
        assert "self.hub = hub" in source(Consumer.__init__)


# -- celery: results ------------------------------------------------------------------------------------


class _Answers(ReadOnlyBackend):
    answers: dict[str, dict[str, Any]] = {}

    def task_meta(self, task_id: str) -> dict[str, Any]:
        return self.answers.get(task_id, meta(task_id, states.PENDING))


def test_celery_results_async_result_reads_task_meta() -> None:
    from datetime import UTC, datetime

    app = Celery("contract", broker="memory://", set_as_current=False)
    app.conf.update(result_serializer="json", accept_content=["json"], result_accept_content=["json"])
    backend = _Answers(app=app)
    done = datetime(2026, 1, 1, tzinfo=UTC)
    backend.answers = {
        "ok": meta("ok", states.SUCCESS, [1, 2], done),
        "bad": meta("bad", states.FAILURE, ValueError("item 3 failed"), done),
        "running": meta("running", states.STARTED),
    }
    with seam("results", "celery", "BaseBackend._get_task_meta_for and its meta dict"):
        ok = app.AsyncResult("ok", backend=backend)
        assert ok.state == states.SUCCESS and ok.ready() and ok.get(timeout=1) == [1, 2]
        assert ok.date_done == done
        with pytest.raises(ValueError, match="item 3 failed"):
            app.AsyncResult("bad", backend=backend).get(timeout=1)
        running = app.AsyncResult("running", backend=backend)
        assert running.state == states.STARTED and not running.ready()
        assert app.AsyncResult("unknown", backend=backend).state == states.PENDING

    cancelled: list[str] = []

    class Recording(CancellingResult):
        def cancel(self, task_id: str) -> None:
            cancelled.append(task_id)

    with seam("results", "celery", "AsyncResult.revoke's signature, and subclass_with_self"):
        parameters = list(inspect.signature(AsyncResult.revoke).parameters)
        assert parameters == ["self", "connection", "terminate", "signal", "wait", "timeout"]
        app.subclass_with_self(Recording)("job-1").revoke(terminate=True)
        assert cancelled == ["job-1"]


# -- kombu: the in-memory transport ---------------------------------------------------------------------


def test_kombu_memory_transport_a_wait_ends_soon_after_a_stop() -> None:
    from celery.worker import loops

    relies_on = "synloop's drain_events(timeout=2.0) between stop checks"
    with seam("the in-memory transport", "celery", relies_on):
        assert "connection.drain_events(timeout=2.0)" in source(loops.synloop)
        connection = Connection("memory://", transport="worker.celery_compat:MemoryTransport")
        try:
            channel = connection.channel()
            channel.basic_consume(f"contract-{uuid.uuid4()}", False, lambda m: None, "contract")
            started = time.monotonic()
            with pytest.raises(socket.timeout):
                connection.drain_events(timeout=2.0)
            assert time.monotonic() - started < 1.0
        finally:
            connection.release()
