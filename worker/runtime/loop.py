"""What runs on the consumer's own thread, on a 5 ms loop timer: acks, intake throttling, leases.

kombu channels belong to the consumer's thread; the engine's threads hand work here instead of
touching them. Nothing here runs models or talks to the database.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any

import redis
from kombu import Queue

from worker.runtime.deliveries import Holdings, Message
from worker.settings import PRIORITIES, Settings, get_settings

log = logging.getLogger(__name__)

ACK_INTERVAL_S = 0.005


def queue_name(priority: str, settings: Settings) -> str:
    return f"{settings.queue}.{priority}"


@lru_cache(maxsize=1)
def broker_redis(url: str) -> redis.Redis | None:
    """A Redis client of our own on the broker, or None for other brokers.

    Never kombu's channel client: while the consumer waits in BRPOP, a command sent on that
    connection would have its reply read as a message.
    """
    if not url.startswith(("redis://", "rediss://", "unix://")):
        return None
    return redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)


class LoopAcks:
    """Acknowledges messages on the consumer's own thread, where kombu expects it.

    With an event loop (Redis) the store thread queues messages and a 5 ms timer acks them; the
    timer also keeps the loop from sleeping a full second before it fetches more. Without one
    (the in-memory broker of the embedded run) acking in place is safe and immediate.
    """

    def __init__(self) -> None:
        self._pending: deque[Message] = deque()
        self._hub: Any = None
        self._timer: Any = None
        self.on_tick: list[Callable[[], None]] = []

    def attach(self, hub: Any) -> None:
        """(Re)start the timer; called at every consumer start, since a reconnect clears the loop's timers."""
        if hub is None:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._hub = hub
        self._timer = hub.call_repeatedly(ACK_INTERVAL_S, self.tick)

    def ack(self, messages: Sequence[Message]) -> None:
        if self._hub is None:
            for message in messages:
                message.ack_log_error(log, (Exception,))  # type: ignore[attr-defined]
        else:
            self._pending.extend(messages)

    def tick(self) -> None:
        self.flush()
        for callback in self.on_tick:
            callback()

    def flush(self) -> None:
        while self._pending:
            self._pending.popleft().ack_log_error(log, (Exception,))  # type: ignore[attr-defined]


class IntakeThrottle:
    """Stops fetching a lane's queue while the worker already holds enough of its items.

    Priority must hold in the broker too: without this, a bulk backlog would fill the prefetch window
    and an urgent message could not even be fetched until bulk messages were acked. The high queue
    is never paused; normal and bulk pause at ``max_held_items`` and resume below half of it. Kept
    on the consumer's thread (the loop timer); queues are re-subscribed in priority order because
    Redis BRPOP serves the queues in the order they were subscribed.
    """

    def __init__(self, consumer: Any, holdings: Holdings, max_held_items: int) -> None:
        self._consumer = consumer
        self._holdings = holdings
        self._limit = max_held_items
        self._paused: set[str] = set()

    def __call__(self) -> None:
        paused = set(self._paused)
        for priority in PRIORITIES[1:]:
            held = self._holdings.items(priority)
            if held >= self._limit:
                paused.add(priority)
            elif held < self._limit // 2:
                paused.discard(priority)
        if paused != self._paused:
            self._resubscribe(paused)

    def _resubscribe(self, paused: set[str]) -> None:
        tasks = self._consumer.task_consumer
        settings = get_settings()
        for priority in PRIORITIES[1:]:
            tasks.cancel_by_queue(queue_name(priority, settings))
        for priority in PRIORITIES[1:]:
            if priority not in paused:
                tasks.add_queue(Queue(queue_name(priority, settings)))
        tasks.consume()
        log.info("intake paused for: %s", ", ".join(sorted(paused)) or "none")
        self._paused = paused


class LeaseRenewal:
    """Keeps the messages this worker holds from being redelivered while it is alive.

    kombu emulates acks on Redis with a sorted set scored by delivery time, and hands back any
    message older than the visibility timeout. Re-scoring the held ones every ``every_s`` turns
    that timeout into a lease: a killed worker's messages return to the queue within
    ``visibility_timeout_s`` (plus one restore sweep), a live worker's never do.
    """

    def __init__(self, consumer: Any, holdings: Holdings, every_s: float) -> None:
        self._consumer = consumer
        self._holdings = holdings
        self._every_s = every_s
        self._renewed = time.monotonic()

    def __call__(self) -> None:
        if time.monotonic() - self._renewed < self._every_s:
            return
        self._renewed = time.monotonic()
        channel = self._consumer.task_consumer.channel
        index = getattr(channel, "unacked_index_key", None)
        client = broker_redis(get_settings().broker_url)
        tags = [d.message.delivery_tag for d in self._holdings.deliveries()]  # type: ignore[attr-defined]
        if index is None or client is None or not tags:
            return  # not Redis, or nothing held
        try:
            client.zadd(index, dict.fromkeys(tags, time.time()), xx=True)
        except Exception as exc:  # the next tick tries again; the lease has slack for that
            log.warning("could not renew leases of %d messages: %s", len(tags), exc)
