"""What runs on the consumer's own thread, on a loop timer: acks, task events, leases, fetch throttling.

kombu channels (and Celery's event dispatcher) belong to the consumer's thread; the engine's threads put
work in the outbox instead of touching them. One tick acknowledges everything stored since the last in one
round trip, sends the task events, and renews every lease due in one command. Nothing here runs models or
talks to the database.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from worker.celery_compat import mark_acked
from worker.runtime.deliveries import Delivery, Holdings
from worker.runtime.hooks.task_events import publish_events

log = logging.getLogger(__name__)

# The tick's period while the worker holds messages or acks and events wait: how long a stored message
# waits for its ack.
TICK_S = 0.005
# ... and while it holds nothing: an idle worker's outbox wakes this often (for its lease renewal and
# hooks), not 200 times a second. Work put in the outbox meanwhile wakes it at once (``Hub.call_soon``).
IDLE_TICK_S = 0.25
# How often the fetch throttle sets its held-items limit again, from the goal and the rate since.
GOAL_REFRESH_S = 0.1
# The fetch throttle's limit holds at least this long a run of items at the rate the worker stores them.
HOLD_S = 0.1
# Items that ran and wait for the store may reach this many times the fetch throttle's limit.
STORE_BACKLOG = 4


@dataclass
class Settled:
    """Deliveries whose items are all stored: to acknowledge, with what the broker may forget with them."""

    deliveries: list[Delivery]
    new_jobs: list[str] = field(default_factory=list)  # now in SQL: their pending records go


class Outbox:
    """Acks and events from any thread, carried out on the consumer's thread by ``tick``.

    With an event loop (Redis) they wait for the tick: every TICK_S while the channel holds messages or work
    waits here, else every IDLE_TICK_S, and woken at once by new work. Without an event loop (the in-memory
    broker of the embedded run) acking and sending in place is safe and immediate.
    """

    def __init__(self, events: Any = None) -> None:
        self._settled: deque[Settled] = deque()
        self._events: deque[dict[str, Any]] = deque()  # task events (hooks/task_events.py)
        self._hub: Any = None
        self._timer: Any = None
        self._channel: Any = None
        self._dispatcher: Callable[[], Any] | None = None
        self.on_tick: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self._idle = False  # the next tick is IDLE_TICK_S away: new work wakes the loop

    def attach(self, hub: Any, channel: Any, dispatcher: Callable[[], Any]) -> None:
        """(Re)start with the consumer: a reconnect clears the loop's timers and brings a new channel."""
        self._channel, self._dispatcher = channel, dispatcher
        if hub is None:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._hub = hub
        self._idle = False
        self._timer = hub.call_later(0, self._tick_and_schedule)

    # -- from any thread ------------------------------------------------------------------

    def settle(self, settled: Settled) -> None:
        self._settled.append(settled)
        self._added()

    def event(self, event: dict[str, Any]) -> None:
        self._events.append(event)
        self._added()

    def _added(self) -> None:
        # Read after the append: an idle tick sets ``_idle`` before it looks at the deques, so either it
        # sees this work or this sees ``_idle`` and wakes it.
        if self._hub is None:
            self.flush()
        elif self._idle:
            self._idle = False
            self._hub.call_soon(self._wake)

    # -- on the consumer's thread ----------------------------------------------------------

    def _wake(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._tick_and_schedule()

    def _tick_and_schedule(self) -> None:
        try:
            self.tick()
        finally:
            self._idle = True
            holding = getattr(getattr(self._channel, "qos", None), "holding", None)
            # Another QoS (no ``holding``): the short tick, always.
            if holding is None or holding() or self._settled or self._events:
                self._idle = False
            self._timer = self._hub.call_later(IDLE_TICK_S if self._idle else TICK_S, self._tick_and_schedule)

    def tick(self) -> None:
        self.flush()
        for callback in self.on_tick:
            try:
                callback()
            except Exception as exc:  # a hook's failure (e.g. Redis away) must not stop acks or the loop
                log.warning("%s failed: %s", getattr(callback, "__name__", type(callback).__name__), exc)

    def flush(self) -> None:
        with self._lock:  # the embedded run flushes from the engine's threads
            batch = _drain(self._settled)
            events = _drain(self._events)
            if batch:
                self._ack(batch)
            if events:
                self._send(events)

    def _ack(self, batch: list[Settled]) -> None:
        deliveries = [d for settled in batch for d in settled.deliveries]
        qos = getattr(self._channel, "qos", None)
        if qos is None or not hasattr(qos, "ack_many"):
            for delivery in deliveries:
                delivery.message.ack_log_error(log, (Exception,))  # type: ignore[attr-defined]
            return
        tags = [d.message.delivery_tag for d in deliveries]
        try:
            qos.ack_many(
                tags,
                lost_ids=[d.task_id for d in deliveries if d.lost],
                jobs=[job for settled in batch for job in settled.new_jobs],
            )
        except Exception as exc:  # stored already: a lost ack only means a redelivery, which stores nothing
            log.warning("could not acknowledge %d messages: %s", len(tags), exc)
        for delivery in deliveries:
            mark_acked(delivery.message)  # as Message.ack would

    def _send(self, events: list[dict[str, Any]]) -> None:
        publish_events(self._dispatcher() if self._dispatcher else None, events)


class LeaseRenewal:
    """Keeps the messages this worker holds from being handed back while it is alive and making progress.

    A held message's lease is its score in the unacked index; the restore sweep hands back any message whose
    lease is older than the visibility timeout. Renewing every held one every ``every_s`` turns that timeout
    into a lease: a killed worker's messages return within ``visibility_timeout_s`` (plus one sweep), a live
    worker's never do. A worker whose store has made no progress for a whole visibility timeout stops
    renewing (and says so), so its messages go to a worker that can store them.
    """

    def __init__(
        self, channel: Any, holdings: Holdings, every_s: float, stalled_s: Callable[[], float], limit_s: float
    ) -> None:
        self._channel = channel
        self._holdings = holdings
        self._every_s = every_s
        self._stalled_s = stalled_s
        self._limit_s = limit_s
        self._renewed = time.monotonic()
        self._warned = False

    def __call__(self) -> None:
        if time.monotonic() - self._renewed < self._every_s:
            return
        self._renewed = time.monotonic()
        tags = [d.message.delivery_tag for d in self._holdings.deliveries()]
        stalled = self._stalled_s()
        if stalled > self._limit_s:
            if not self._warned:
                log.error(
                    "the database has refused every write for %.0f s: no longer renewing the leases of %d "
                    "messages, so other workers can take them", stalled, len(tags),
                )  # fmt: skip
                self._warned = True
            return
        self._warned = False
        if tags and hasattr(self._channel, "renew_leases"):
            self._channel.renew_leases(tags)


class FetchThrottle:
    """How many messages the worker may fetch from each queue now (the transport's fetch gate).

    Priority must hold in the broker too. Normal and bulk stop when the items they hold waiting to run reach
    the limit (resuming below half), and a fetch takes no more of their messages than fits under it, judged
    by the size of the last message of that priority (one message while none has been seen); they also leave
    part of the prefetch window free, so an urgent message can always be fetched. High is never throttled.
    Nothing is fetched while the store is stalled.

    The limit is what the worker runs in HOLD_S at the rate it has been storing items, or ``hold_goal()`` (a
    few of the largest batches the loaded models form) if that is more, at most ``max_held_items``: what
    one worker holds waiting, no other can run, so with several workers each takes only what it will run
    soon and a burst of messages spreads over all of them, while a worker that finishes batches in a few
    milliseconds (a small model on a fast device) holds enough to keep its threads busy. Items that have
    run and wait for the store count against a bound STORE_BACKLOG times larger instead: no other worker
    could run them, and the larger bound still stops a worker whose store lags from fetching without end.
    Measured in bench/README.md, "The fetch throttle".
    """

    def __init__(
        self,
        holdings: Holdings,
        max_held_items: int,
        priority_of: dict[str, str],
        reserve: int,
        stalled_s: Callable[[], float],
        hold_goal: Callable[[], int] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._holdings = holdings
        self._max = max_held_items
        self._limit = max_held_items
        self._priority_of = priority_of  # throttled queue name -> its priority (normal, bulk)
        self._reserve = reserve  # prefetch slots kept for unthrottled (high) messages
        self._stalled_s = stalled_s
        self._hold_goal = hold_goal
        self._clock = clock
        self._goal_read = -math.inf
        self._handed_then = 0
        self._paused: set[str] = set()

    def __call__(self, queues: Sequence[str], room: int) -> list[tuple[str, int]]:
        if self._stalled_s() > 0:
            return []
        now = self._clock()
        if self._hold_goal is not None and now - self._goal_read > GOAL_REFRESH_S:
            self._set_limit(now, self._hold_goal())
        plan = []
        for queue in queues:
            priority = self._priority_of.get(queue)
            plan.append((queue, room if priority is None else self._allowed(queue, priority, room)))
        return plan

    def _set_limit(self, now: float, goal: int) -> None:
        handed = self._holdings.handed_items()
        if math.isfinite(self._goal_read):
            rate = (handed - self._handed_then) / (now - self._goal_read)
            goal = max(goal, int(rate * HOLD_S))
        self._goal_read, self._handed_then = now, handed
        self._limit = max(1, min(self._max, goal))

    def _allowed(self, queue: str, priority: str, room: int) -> int:
        # Waiting items against the limit, all unstored ones against the store's larger bound.
        waiting, held = self._holdings.waiting(priority), self._holdings.items(priority)
        bound = self._limit * STORE_BACKLOG
        if waiting >= self._limit or held >= bound:
            self._pause(queue, True)
        elif waiting < self._limit // 2 and held < bound // 2:
            self._pause(queue, False)
        if queue in self._paused:
            return 0
        # Messages fetched from this queue but not yet read hold items the counts do not show yet: each counts
        # as one message of its priority, or, before the first is read, stops further fetches until it is.
        # Without this a worker fetches again every few milliseconds while its prepare thread catches up, and
        # takes several times its limit (a fresh worker took 7 messages of 50 against a limit of 128).
        size, unread = self._holdings.message_items(priority), self._holdings.unread(queue)
        if size is None:
            messages = 0 if unread else 1
        else:
            fits = min(self._limit - waiting, bound - held) - unread * size
            messages = 0 if fits <= 0 else max(1, fits // max(1, size))
        return max(0, min(messages, room - self._reserve))

    def _pause(self, queue: str, paused: bool) -> None:
        if paused != (queue in self._paused):
            (self._paused.add if paused else self._paused.discard)(queue)
            log.info("fetching paused for: %s", ", ".join(sorted(self._paused)) or "none")


def _drain(items: deque[Any]) -> list[Any]:
    drained = []
    while items:
        drained.append(items.popleft())
    return drained
