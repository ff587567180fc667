"""kombu's Redis transport, fetching many messages per round trip and holding them with leases, atomically.

kombu's own Redis channel reads one message per BRPOP and only then records it as unacked, in a second
round trip (a worker killed in between loses the message), acks with one pipeline per message, and restores
expired messages under a lock that lives 300 s (a worker killed while holding it stops every restore for
five minutes). Here one Lua script pops up to K messages across the priority queues and records them as
held in the same step; acks, lease renewals and hand-backs go in one round trip for many messages; the
restore sweep is one script, with no lock. Everything else (publishing, fanout for events and remote
control, reconnects) is kombu's. Runs on the consumer's thread only, like every kombu channel.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import orjson

from worker.broker import scripts
from worker.broker.keys import Keys
from worker.celery_compat import (
    FanoutPoller,
    FetchingChannel,
    FetchingTransport,
    HeldQoS,
    poll_again_after,
)

log = logging.getLogger(__name__)

# Messages taken per round trip at most (and never more than the prefetch window has room for).
FETCH_LIMIT = 256
# With nothing waiting, the fetch backs off from 1 ms, doubling, to this while the worker holds messages
# (its items run: more may come behind them).
IDLE_FETCH_S = 0.02
# ... and to this while it holds none: a message arriving into an idle worker waits at most this long in
# Redis, and an idle worker costs Redis a trivial script, and itself a turn of its loop, this often (at
# IDLE_FETCH_S the idle fetch was most of an idle worker's CPU).
EMPTY_FETCH_S = 0.1
# A worker holding all it may (prefetch window or fetch throttle) checks again this often, no round trip:
# the outbox's tick (5 ms), whose acks release what it holds.
HELD_BACK_FETCH_S = 0.005
# kombu's hub fires at most 10 due timers per turn of its loop; when all 10 ran (a busy worker whose fetch
# and ack timers are due again as soon as they finish) it polls for ``min_delay``, one whole second by
# default: the worker would stall a second at a time exactly when messages keep coming. A busy loop comes
# back after this instead.
HUB_MIN_DELAY_S = 0.001
# Messages one restore sweep hands back at most.
RESTORE_LIMIT = 1000


class QoS(HeldQoS):
    """Held messages: the fetch script records them in Redis, so ``append`` only keeps them in memory."""

    def append(self, message: Any, delivery_tag: str) -> None:
        self.hold_in_memory(message, delivery_tag)

    def ack(self, delivery_tag: str) -> None:
        self.ack_many([delivery_tag])

    def ack_many(
        self,
        delivery_tags: Iterable[str],
        lost_ids: Iterable[str] = (),
        jobs: Iterable[str] = (),
    ) -> None:
        """Forget these messages in one round trip: their items are stored, never to be handed back. With
        them go their lost counts and the pending records of ``jobs`` now in SQL."""
        jobs = list(jobs)
        tags, ids, job_keys = list(delivery_tags), list(lost_ids), [self.channel.keys.job(j) for j in jobs]
        keys = self.channel.keys
        with self.channel.conn_or_acquire() as client:
            pipe = client.pipeline(transaction=False)
            if tags:
                pipe.hdel(keys.unacked, *tags).zrem(keys.unacked_index, *tags)
            if ids:
                pipe.hdel(keys.lost, *ids)
            if job_keys:
                pipe.delete(*job_keys)
                pipe.zrem(keys.pending_jobs, *jobs)
            pipe.execute()
        self.forget_in_memory(tags)

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        if requeue:
            self.channel.hand_back([delivery_tag])
        else:
            self.ack_many([delivery_tag])
            return
        self.forget_in_memory([delivery_tag])

    def restore_unacked(self, client: Any = None) -> None:
        """At channel close (a worker stopping): hand back everything still held, in one round trip."""
        tags = self.take_all_held()
        if tags:
            self.channel.hand_back(tags)

    def restore_visible(self, start: int = 0, num: int = 10, interval: int = 10) -> None:
        """Hand back the messages whose lease ran out (their worker is gone); no lock, atomic per sweep."""
        channel = self.channel
        horizon = time.time() - channel.visibility_timeout
        with channel.conn_or_acquire() as client:
            restored = channel.script(client, "restore_expired")(
                keys=[channel.keys.unacked, channel.keys.unacked_index, channel.keys.lost],
                args=[horizon, RESTORE_LIMIT],
            )
        if restored:
            log.warning("handed back %d messages whose worker stopped renewing their lease", restored)


class Channel(FetchingChannel):
    QoS = QoS
    # kombu copies these transport options onto the channel; mypy reads kombu's tuple as fixed-length.
    from_transport_options = FetchingChannel.from_transport_options + ("batchwork_prefix",)  # type: ignore[assignment]
    batchwork_prefix = "batchwork"
    # How many messages to fetch from each consumed queue now, given the room in the prefetch window (the
    # worker's fetch throttle); None: as many as there is room for, from any.
    fetch_gate: Callable[[list[str], int], list[tuple[str, int]]] | None = None
    # Whether the last fetch asked for nothing (the prefetch window or the gate allowed none).
    held_back = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.keys = Keys(self.batchwork_prefix)
        self._scripts: dict[str, Any] = {}

    def script(self, client: Any, name: str) -> Any:
        source = {
            "fetch": scripts.FETCH,
            "restore": scripts.RESTORE,
            "restore_expired": scripts.RESTORE_EXPIRED,
        }
        if name not in self._scripts:
            self._scripts[name] = client.register_script(source[name])
        return self._scripts[name]

    def fetch(self) -> int:
        """Take up to FETCH_LIMIT waiting messages (most urgent queue first) and deliver them; how many."""
        room = self.qos.can_consume_max_estimate()
        room = FETCH_LIMIT if room is None else room  # None: no prefetch limit
        limit = min(FETCH_LIMIT, room)
        # The gate sees the whole room of the prefetch window (it keeps part of it for urgent messages).
        plan = [(queue, min(most, limit)) for queue, most in self._plan(room) if most > 0]
        self.held_back = limit <= 0 or not plan
        if self.held_back:
            return 0
        queues, most = [queue for queue, _ in plan], [count for _, count in plan]
        keys = [self.keys.unacked, self.keys.unacked_index, self.keys.lost, self.keys.delivery_tags, *queues]
        with self.conn_or_acquire() as client:
            taken = self.script(client, "fetch")(keys=keys, args=[time.time(), limit, *most])
        for i in range(0, len(taken), 4):
            tag, queue, raw, lost = taken[i : i + 4]
            self._deliver_one(tag.decode(), queue.decode(), raw, int(lost))
        return len(taken) // 4

    def hand_back(self, tags: list[str]) -> None:
        """Put held messages back at the head of their queues, for another worker (not counted as lost)."""
        with self.conn_or_acquire() as client:
            self.script(client, "restore")(
                keys=[self.keys.unacked, self.keys.unacked_index, self.keys.lost], args=tags
            )

    def renew_leases(self, tags: list[str]) -> None:
        """Restart the lease of every held message in one command (never re-adds an acked one)."""
        if tags:
            with self.conn_or_acquire() as client:
                client.zadd(self.keys.unacked_index, dict.fromkeys(tags, time.time()), xx=True)

    def _plan(self, room: int) -> list[tuple[str, int]]:
        """The consumed queues in priority order, with how many messages each may give now, given ``room``
        in the prefetch window."""
        consumed = set(self.active_queues)
        queues = [queue for queue in self.keys.queues if queue in consumed]
        queues += [queue for queue in self.active_queues if queue not in queues]
        if self.fetch_gate is None:
            return [(queue, room) for queue in queues]
        return self.fetch_gate(queues, room)

    def _deliver_one(self, tag: str, queue: str, raw: bytes, lost: int) -> None:
        try:
            payload = orjson.loads(raw)
            payload["properties"]["delivery_tag"] = tag
            payload["properties"]["batchwork_lost"] = lost
            payload["properties"]["batchwork_queue"] = queue  # the fetch throttle's count of unread messages
        except (orjson.JSONDecodeError, TypeError, KeyError) as exc:
            # Not a kombu message (something else pushed to our queue): nothing can run it; never hold it.
            log.error("dropped a message in %s that is not a kombu message (%s): %r", queue, exc, raw[:200])
            self.qos.ack_many([tag])
            return
        try:
            self.deliver(payload, queue)
        except Exception as exc:  # never the rest of the fetch: those are held in Redis already
            if self.qos.holds(tag):  # past kombu's decoding: whoever took it settles it
                log.exception("handing message %s in %s to its consumer failed", tag, queue)
                return
            # kombu could not make it a message (its body's encoding, its envelope's types): no one holds it.
            log.error("dropped a message in %s that kombu cannot decode (%s): %r", queue, exc, raw[:200])
            self.qos.ack_many([tag])


class Poller(FanoutPoller):
    """kombu's poller for fanout (events, remote control) without BRPOP; queues are fetched on a timer."""

    def get(self, callback: Any, timeout: float | None = None) -> None:
        # Without an event loop (drain_events), fetch here, then wait on the fanout connections as kombu does.
        for channel in self.served_channels():
            if channel.active_queues and channel.qos.can_consume() and channel.fetch():
                return
        super().get(callback, min(timeout, IDLE_FETCH_S) if timeout is not None else IDLE_FETCH_S)


class Transport(FetchingTransport):
    Channel = Channel
    poller_class = Poller
    cycle: Poller

    def register_with_event_loop(self, connection: Any, loop: Any) -> None:
        super().register_with_event_loop(connection, loop)
        # Celery builds its loop after this, from this attribute; a reconnect registers again.
        poll_again_after(loop, HUB_MIN_DELAY_S)
        fetcher = getattr(self, "_fetcher", None)
        if fetcher is not None:
            fetcher.stop()  # a reconnect registers again: one fetch loop at a time
        self._fetcher = Fetcher(self.cycle, loop)
        self._fetcher.schedule(0)


class Fetcher:
    """Fetches on the event loop: again at once while messages keep coming, backing off while none do."""

    def __init__(self, cycle: Poller, loop: Any) -> None:
        self.cycle = cycle
        self.loop = loop
        self.idle_s = 0.0
        self._timer: Any = None
        self._stopped = False

    def schedule(self, delay_s: float) -> None:
        if not self._stopped:
            self._timer = self.loop.call_later(delay_s, self.tick)

    def stop(self) -> None:
        self._stopped = True
        if self._timer is not None:
            self._timer.cancel()

    def tick(self) -> None:
        taken, held_back, holding = 0, False, False
        try:
            for channel in self.cycle.served_channels():
                if not channel.active_queues:
                    continue
                holding = holding or channel.qos.holding()
                if channel.qos.can_consume():
                    taken += channel.fetch()
                    held_back = held_back or channel.held_back
                else:
                    held_back = True
        except Exception as exc:  # connection errors: kombu reconnects; try again after a pause
            log.warning("fetching messages failed: %s", exc)
            self.schedule(IDLE_FETCH_S)
            raise
        if taken:
            self.idle_s = 0.0
        elif held_back:
            # The worker holds enough: it asked Redis nothing, so asking again soon costs nothing, and it
            # must not sleep the idle backoff just when its items run low (the throttle resumes).
            self.idle_s = HELD_BACK_FETCH_S
        else:
            self.idle_s = min(IDLE_FETCH_S if holding else EMPTY_FETCH_S, max(0.001, self.idle_s * 2))
        self.schedule(self.idle_s)
