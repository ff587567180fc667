"""kombu's private parts batchwork relies on, one section per seam; a kombu upgrade reads this file against
the new version (contract tests: tests/unit/celery_compat/test_celery_compat.py, pinned to
pyproject.toml's kombu).

- The Redis transport (worker/broker/transport.py builds on these classes): ``Channel._brpop_start`` and
  ``MultiChannelPoller._register_BRPOP`` silenced, ``Channel._create_client`` shared, the poller's
  ``_channels`` walked, ``Transport.cycle`` replaced, ``Connection._deliver`` called, ``QoS._delivered`` /
  ``QoS._dirty`` / ``QoS._flush`` and ``virtual.QoS.append`` / ``.ack`` reached past the Redis QoS.
- The event loop: ``Hub.fire_timers``' one-second ``min_delay`` after a busy turn.
- Messages: ``Message._state``, marked ``"ACK"`` for messages acked many at a time.
- Serializers: ``registry.type_to_name``, restored after an encoder of our own registers for JSON.
- The in-memory transport of the embedded run, stopping promptly (Celery's ``synloop`` waits two seconds).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from kombu.serialization import registry
from kombu.transport import memory
from kombu.transport import redis as kombu_redis

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

    def forget_in_memory(self, delivery_tag: str) -> None:
        """Forget a message once Redis has (acked or handed back in one round trip for many)."""
        kombu_redis.virtual.QoS.ack(self, delivery_tag)

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
