"""kombu's Redis transport, the private parts batchwork's channel (worker/broker/transport.py) replaces or
reaches: here, so a kombu upgrade finds them in one file (contract: tests/unit/test_celery_compat.py).

- ``Channel._brpop_start`` / ``MultiChannelPoller._register_BRPOP``: the channel's BRPOP and its registration
  with the event loop. No-ops: messages are taken by a fetch script that records them as held in the same
  step (a BRPOP takes one message and records it only in a second round trip).
- ``Channel._create_client``: kombu builds a redis-py client per command; one is shared per channel.
- ``MultiChannelPoller._channels``: the channels the poller serves, which the fetch loop walks.
- ``Transport.cycle``: the transport's poller, replaced by the one above.
- ``Connection._deliver(payload, queue)``: hands a raw message to the consumer's callback for its queue
  (what kombu's BRPOP reply handler calls).
- ``QoS._delivered`` / ``QoS._flush``: the messages a channel holds, handed back all at once at close; and
  the in-memory bookkeeping of ``virtual.QoS.append`` / ``.ack``, called past kombu's Redis QoS (which would
  write each held message to Redis again, and ack it with a round trip of its own).
"""

from __future__ import annotations

from typing import Any

from kombu.transport import redis as kombu_redis


class HeldQoS(kombu_redis.QoS):
    """kombu's Redis QoS, with its in-memory bookkeeping reachable without its Redis writes."""

    def hold_in_memory(self, message: Any, delivery_tag: str) -> None:
        """Remember a delivered message (the fetch script already recorded it in Redis)."""
        kombu_redis.virtual.QoS.append(self, message, delivery_tag)

    def forget_in_memory(self, delivery_tag: str) -> None:
        """Forget a message once Redis has (acked or handed back in one round trip for many)."""
        kombu_redis.virtual.QoS.ack(self, delivery_tag)

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
