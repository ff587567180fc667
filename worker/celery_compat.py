"""Celery's and kombu's private seams, in one room: every place batchwork relies on something the frameworks
do not promise (a private method, an attribute, a message layout, a default) is a section of this module,
naming the private thing it uses and why. A Celery or kombu upgrade reads this file against the new version;
tests/unit/test_celery_compat.py holds one contract test per seam, pinned to the versions in pyproject.toml,
and tests/unit/test_code_quality.py fails if a module elsewhere reaches one of those private things. Public
Celery and kombu API (``Celery``, ``Task``, ``bootsteps``, ``kombu.Queue``) is used where it stands.

Celery's:
- The task message: protocol 2's headers and body, written by hand by producers in kombu's Redis envelope.
- Publishing plainly: ``Task.apply_async`` called unbound, past a task class that overrides it.
- The consumer: its bootsteps named by module path, ``Consumer.create_task_handler`` (the per-message handler
  its loop installs), and the consumer's ``task_consumer``, ``hub`` and ``event_dispatcher`` attributes.
- Task events: ``EventDispatcher._publish`` of a "task.multi" list, with the dispatcher's ``groups``,
  ``mutex``, ``producer``, ``serializer`` and its outbound buffer's ``flush``.
- Results: ``BaseBackend._get_task_meta_for`` and the meta dict it returns; ``AsyncResult.revoke``'s
  signature.

kombu's:
- The Redis transport (worker/broker/transport.py builds on these classes): ``Channel._brpop_start`` and
  ``MultiChannelPoller._register_BRPOP`` silenced, ``Channel._create_client`` shared, the poller's
  ``_channels`` walked, ``Transport.cycle`` replaced, ``Connection._deliver`` called, ``QoS._delivered``
  (popped directly) / ``QoS._dirty`` / ``QoS._flush`` and ``virtual.QoS.append`` reached past the Redis QoS.
- The event loop: ``Hub.fire_timers``' one-second ``min_delay`` after a busy turn.
- Messages: ``Message._state``, marked ``"ACK"`` for messages acked many at a time.
- Serializers: ``registry.type_to_name``, restored after an encoder of our own registers for JSON.
- The in-memory transport of the embedded run, stopping promptly (Celery's ``synloop`` waits two seconds).
"""

from __future__ import annotations

import base64
import uuid
from collections import deque
from collections.abc import Callable, Iterable
from datetime import datetime
from functools import partial
from itertools import repeat
from typing import Any

import orjson
from celery import Task
from celery.backends.base import BaseBackend
from celery.result import AsyncResult
from kombu.serialization import registry
from kombu.transport import memory
from kombu.transport import redis as kombu_redis

# -- the task message -----------------------------------------------------------------------------------
# What Celery's ``amqp.as_task_v2`` writes and a worker reads: the headers, the body ``[args, kwargs,
# embed]``, and the JSON kombu's Redis channel pushes to a queue list (body base64-encoded, the delivery info
# in the properties). Celery's own publish path costs a producer about as much as the whole Redis round trip,
# so producers write the same bytes directly; any Celery worker can read them.

# The body's third part (protocol 2's "embed"): no callbacks, errbacks, chain or chord.
_EMBED = b'{"callbacks":null,"errbacks":null,"chain":null,"chord":null}'


def task_message(
    task_name: str, task_id: str, queue: str, kwargs: bytes, *, kwargsrepr: str, origin: str
) -> bytes:
    """The message kombu's Redis channel would push to ``queue`` for Celery's ``apply_async`` of
    ``task_name`` with no args and ``kwargs`` (their JSON object, as bytes), ignoring its result."""
    body = b"[[]," + kwargs + b"," + _EMBED + b"]"
    headers: dict[str, Any] = {
        "lang": "py",
        "task": task_name,
        "id": task_id,
        "shadow": None,
        "eta": None,
        "expires": None,
        "group": None,
        "group_index": None,
        "retries": 0,
        "timelimit": [None, None],
        "root_id": task_id,
        "parent_id": None,
        "argsrepr": "()",
        "kwargsrepr": kwargsrepr,
        "origin": origin,
        "ignore_result": True,
        "replaced_task_nesting": 0,
        "stamped_headers": None,
        "stamps": {},
    }
    properties = {
        "correlation_id": task_id,
        "reply_to": None,
        "delivery_mode": 2,
        "delivery_info": {"exchange": "", "routing_key": queue},
        "priority": 0,
        "body_encoding": "base64",
        "delivery_tag": str(uuid.uuid4()),
    }
    return orjson.dumps(
        {
            "body": base64.b64encode(body).decode(),
            "content-encoding": "utf-8",
            "content-type": "application/json",
            "headers": headers,
            "properties": properties,
        }
    )


# -- publishing plainly ---------------------------------------------------------------------------------
# ``InferTask.apply_async`` is batchwork's enqueue (it checks a whole call and writes through the Redis
# producer); the in-process path of ``batchwork run`` needs Celery's plain publish to its in-memory broker
# instead, with ``argsrepr``/``kwargsrepr`` passed on to the message's headers.


def publish_plainly(task: Task, kwargs: dict[str, Any], **options: Any) -> Any:
    """Celery's own ``apply_async`` of ``task`` (with ``options`` such as ``queue``, ``producer``,
    ``task_id``, ``kwargsrepr``), whatever ``task``'s class does in its own."""
    return Task.apply_async(task, kwargs=kwargs, **options)


# -- the consumer ---------------------------------------------------------------------------------------
# A step that needs the task consumer's channel and the event dispatcher starts after the consumer's own
# steps that make them, and ``requires`` names those by module path. Celery's loops (``asynloop``,
# ``synloop``) ask ``consumer.create_task_handler()`` for the function they call with each raw message, each
# time the consumer (re)starts, after every step started. Celery's own handler finds the task's strategy and
# makes two promises (ack, reject) per message, 1.3-1.8 µs a message here, which batchwork never calls (it
# acks many messages at once); the direct handler costs 0.12 µs. The consumer's ``task_consumer.channel``,
# ``hub`` and ``event_dispatcher`` are read when a step starts (a reconnect brings new ones).

# A consumer step that runs after these has the task consumer (its channel) and the event dispatcher.
AFTER_TASKS_AND_EVENTS = ("celery.worker.consumer.events:Events", "celery.worker.consumer.tasks:Tasks")


def deliver_directly(consumer: Any, task_name: str, on_message: Callable[[Any], None]) -> None:
    """Make ``consumer``'s loop hand each raw message of ``task_name`` to ``on_message``; any other message
    (another task, no headers) goes through Celery's own handler, which rejects or runs it as Celery does.
    Called from a step's start, before the loop asks for its handler; a restart calls it again."""
    celerys = type(consumer).create_task_handler.__get__(consumer)

    def create_task_handler() -> Callable[[Any], None]:
        others = celerys()

        def on_task_received(message: Any) -> None:
            headers = message.headers
            if type(headers) is dict and headers.get("task") == task_name:
                on_message(message)
            else:
                others(message)

        return on_task_received

    consumer.create_task_handler = create_task_handler


def task_channel(consumer: Any) -> Any:
    """The channel the consumer's tasks come through now (a reconnect replaces it)."""
    return consumer.task_consumer.channel


def event_loop(consumer: Any) -> Any:
    """The consumer's event loop (a kombu Hub), or None without one (a transport that only polls)."""
    return consumer.hub


def event_dispatcher(consumer: Any) -> Any:
    """The consumer's task event dispatcher, or None before its step started."""
    return getattr(consumer, "event_dispatcher", None)


# -- task events ----------------------------------------------------------------------------------------
# A worker's dispatcher buffers task events (``buffer_group``) and publishes each buffer as one list, routed
# "task.multi", through ``EventDispatcher._publish``; Flower reads such a list as it reads single events. Each
# event is the dict ``celery.events.Event`` makes (type, timestamp, the fields) plus what ``send`` adds
# (hostname, utcoffset, pid, clock). ``send`` costs several microseconds an event in Python (three a message);
# batchwork builds the dicts itself and publishes a tick's list at once. ``.groups`` says which event groups
# the worker was asked for (None: all). ``.serializer`` is read at every publish.


def task_events_wanted(dispatcher: Any) -> bool:
    """Whether Celery's ``dispatcher`` sends task events (the worker was asked for them)."""
    return bool(dispatcher.enabled) and (not dispatcher.groups or "task" in dispatcher.groups)


def publish_task_events(dispatcher: Any, events: list[dict[str, Any]], serializer: str) -> None:
    """Publish ``events`` (dicts as ``send`` would buffer them) as one "task.multi" message written with
    ``serializer``, as the dispatcher's own flush of its buffer does. A publish that failed (the broker
    away) left its events in the dispatcher's outbound buffer: they are tried once more first, then
    dropped, as Celery's own ``flush`` does, so a worker's outages never pile them up."""
    dispatcher.serializer = serializer
    dispatcher.flush(errors=True, groups=False)
    with dispatcher.mutex:
        dispatcher._publish(events, dispatcher.producer, "task.multi")


# -- results --------------------------------------------------------------------------------------------
# Every read of an ``AsyncResult`` goes through ``BaseBackend._get_task_meta_for(task_id)`` and the meta dict
# it returns; Celery documents no other way to answer reads without storing results through it.


class ReadOnlyBackend(BaseBackend):
    """A result backend whose reads are ``task_meta``'s answers; nothing is stored through it."""

    def _get_task_meta_for(self, task_id: str) -> dict[str, Any]:
        return self.task_meta(task_id)

    def task_meta(self, task_id: str) -> dict[str, Any]:
        """The task's state as ``meta`` makes it."""
        raise NotImplementedError


# ``AsyncResult.revoke`` broadcasts a revoke that only Celery's own task handling reads, which batchwork's
# workers bypass (``deliver_directly``): a result class whose ``revoke``, with Celery's signature, cancels.


class CancellingResult(AsyncResult):  # type: ignore[misc]  # celery ships no types
    """Celery's AsyncResult whose ``revoke()`` calls ``cancel(task_id)``, which a subclass defines."""

    def revoke(self, connection: Any = None, terminate: bool = False, signal: Any = None, wait: bool = False,
               timeout: float | None = None) -> None:  # fmt: skip
        self.cancel(self.id)

    def cancel(self, task_id: str) -> None:
        raise NotImplementedError


def meta(task_id: str, status: str, result: Any = None, done: datetime | None = None) -> dict[str, Any]:
    """What Celery reads for a task: its state, its result (or exception) and when it finished."""
    return {
        "task_id": task_id,
        "status": status,
        "result": result,
        "traceback": None,
        "children": [],
        "date_done": done,
    }


# -- the Redis transport --------------------------------------------------------------------------------
# kombu's BRPOP takes one message and records it as unacked only in a second round trip (a worker killed in
# between loses it); batchwork's channel takes many with a script that records them in the same step, so the
# BRPOP and its registration with the event loop are silenced and the fetch loop walks the poller's channels
# itself, delivering through the connection's ``_deliver`` as kombu's BRPOP reply handler does. What a
# channel holds is kept by the virtual QoS's in-memory bookkeeping, reached past kombu's Redis QoS (which
# would write each held message to Redis again and ack each with a round trip of its own).


class HeldQoS(kombu_redis.QoS):
    """kombu's Redis QoS, with its in-memory bookkeeping reachable without its Redis writes."""

    def hold_in_memory(self, message: Any, delivery_tag: str) -> None:
        """Remember a delivered message (the fetch script already recorded it in Redis)."""
        kombu_redis.virtual.QoS.append(self, message, delivery_tag)

    def forget_in_memory(self, delivery_tags: Iterable[str]) -> None:
        """Forget messages once Redis has (acked or handed back, in one round trip for many). Popped at once
        rather than marked dirty (``virtual.QoS.ack``) for the next ``append`` to pop one by one, which was
        a few per cent of a draining worker's consumer thread: only the consumer's thread, which acks,
        changes ``_delivered``."""
        deque(map(self._delivered.pop, delivery_tags, repeat(None)), maxlen=0)

    def holds(self, delivery_tag: str) -> bool:
        """Whether this delivered message was handed to a consumer and is not acknowledged yet."""
        return delivery_tag in self._delivered

    def holding(self) -> bool:
        """Whether any delivered message is not acknowledged yet: its acks and events are still to come, so
        the worker's timers keep their short periods (``can_consume`` counts the same way: delivered
        messages less those acked since the last flush)."""
        return len(self._delivered) > len(self._dirty)

    def take_all_held(self) -> list[str]:
        """The delivery tags of every message still held, forgotten here (a channel closing)."""
        self._flush()
        tags = list(self._delivered)
        self._delivered.clear()
        return tags


class FetchingChannel(kombu_redis.Channel):
    """kombu's Redis channel that never BRPOPs and shares one client for every command."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._shared_client: Any = None
        super().__init__(*args, **kwargs)

    def _create_client(self, asynchronous: bool = False) -> Any:
        """One synchronous client per channel, for every fetch, ack, lease renewal and event publish. kombu
        makes a new one per command (``conn_or_acquire``), and redis-py's constructor costs about 0.2 ms
        (its table of response callbacks), more than the fetch script's round trip; a client only borrows
        connections from the channel's pool, so sharing one is safe."""
        if asynchronous:
            return super()._create_client(asynchronous=True)
        if self._shared_client is None:
            self._shared_client = super()._create_client()
        return self._shared_client

    def _brpop_start(self, timeout: int | None = None) -> None:
        """Never BRPOP: messages are taken by the channel's fetch, which records them as held in one step."""

    def deliver(self, payload: dict[str, Any], queue: str) -> None:
        """Hand a raw message (kombu's envelope, as a dict) to the consumer of ``queue``."""
        self.connection._deliver(payload, queue)


class FanoutPoller(kombu_redis.MultiChannelPoller):
    """kombu's poller for fanout (events, remote control) without BRPOP; queues are fetched on a timer."""

    def _register_BRPOP(self, channel: Any) -> None:
        pass

    def served_channels(self) -> list[Any]:
        """The channels this poller serves now (a copy: a reconnect changes the set)."""
        return list(self._channels)


class FetchingTransport(kombu_redis.Transport):
    """kombu's Redis transport with ``poller_class`` in place of its BRPOP poller."""

    poller_class: type[FanoutPoller] = FanoutPoller

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cycle: FanoutPoller = self.poller_class()  # type: ignore[assignment]  # kombu types it as its own


# -- the event loop -------------------------------------------------------------------------------------
# kombu's Hub fires at most 10 due timers per turn of its loop; when all 10 ran it polls for ``min_delay``,
# one whole second by default, and nothing lets a transport change that default. Celery's loop
# (``Hub.create_loop``) reads ``hub.fire_timers`` as an attribute once it starts, after the transport
# registered with the loop, so the transport replaces the attribute there.


def poll_again_after(loop: Any, min_delay_s: float) -> None:
    """Make ``loop`` poll for at most ``min_delay_s`` after a turn that fired its whole share of timers.
    Safe to call again (a reconnect registers the transport again)."""
    if not isinstance(loop.fire_timers, partial):
        loop.fire_timers = partial(loop.fire_timers, min_delay=min_delay_s)


# -- messages -------------------------------------------------------------------------------------------
# ``Message.ack`` sets ``Message._state`` to "ACK", and ``Message.acknowledged`` reads it. The worker acks
# many messages in one round trip (the transport's ``QoS.ack_many``), never through each message's ``ack``
# (one round trip each); each is marked as ``ack`` would mark it, so nothing (Celery at shutdown, a later
# reject) acks or rejects it a second time.


def mark_acked(message: Any) -> None:
    """Record on ``message`` that the broker has forgotten it, as ``Message.ack`` would."""
    message._state = "ACK"


# -- serializers ----------------------------------------------------------------------------------------
# Registering an encoder for a content type also makes it the name kombu reads that type under (and sends
# replies under), in ``registry.type_to_name``; the name kombu had is put back, so only a sender that asks
# for the new serializer by name (the task event dispatcher) uses it.


def register_encoder(name: str, encode: Callable[[Any], str], content_type: str, encoding: str) -> None:
    """An encoder kombu knows as ``name``, writing ``content_type``; reading that type stays kombu's."""
    previous = registry.type_to_name.get(content_type)
    registry.register(name, encode, None, content_type, encoding)
    if previous is not None:
        registry.type_to_name[content_type] = previous


# -- the in-memory transport ----------------------------------------------------------------------------
# Celery drives a transport without an event loop (``celery.worker.loops.synloop``) with
# ``connection.drain_events(timeout=2.0)`` and looks for a stop request only between two calls, so an
# in-process worker (``batchwork run`` with no broker) took two seconds to stop after its last message.

# How long one wait for a message lasts at most: how soon a stop is noticed.
STOP_CHECK_S = 0.05


class MemoryTransport(memory.Transport):
    def drain_events(self, connection: Any, timeout: Any = None, **kwargs: Any) -> Any:
        wait_s = STOP_CHECK_S if timeout is None else min(timeout, STOP_CHECK_S)
        return super().drain_events(connection, timeout=wait_s, **kwargs)
