"""batchwork's Redis channel on a real Redis: many messages per round trip, held with leases in the same step,
acked and renewed in one round trip, handed back without a lock, and nothing lost to a SIGKILL."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from kombu import Connection
from kombu.asynchronous import Hub

from tests.integration.processes import ROOT
from worker.broker.keys import Keys
from worker.broker.producer import Publisher
from worker.calls import NewJob
from worker.runtime.deliveries import Holdings
from worker.runtime.outbox import FetchThrottle
from worker.store.values import JobSpec

KEYS = Keys("batchwork")
TRANSPORT = "worker.broker.transport:Transport"


def publish(url: str, count: int, priority: str = "normal") -> str:
    """``count`` one-item messages of one job; its id."""
    job_id = str(uuid.uuid4())
    call = NewJob(job_id, "noop", [f"item {i}" for i in range(count)], priority, total=count)
    Publisher(url, KEYS, chunk_size=1).enqueue(call)
    return job_id


@pytest.fixture
def redis_url(own_redis_url: str) -> str:
    """Tests here count the server's commands (INFO commandstats is server-wide): each has a redis-server of
    its own, so nothing but the test itself is counted."""
    return own_redis_url


@pytest.fixture
def channel(redis_url: str) -> Iterator[tuple[Any, list[Any], redis.Redis]]:
    """A channel consuming the three priority queues; delivered messages collect in the list."""
    connection = Connection(redis_url, transport=TRANSPORT, transport_options={"visibility_timeout": 1})
    chan = connection.channel()
    received: list[Any] = []
    for queue in KEYS.queues:
        chan.basic_consume(queue, no_ack=False, callback=received.append, consumer_tag=queue)
    client = redis.Redis.from_url(redis_url)
    yield chan, received, client
    client.close()
    connection.release()


def evals(client: redis.Redis) -> int:
    stats = client.info("commandstats")
    return sum(stats.get(f"cmdstat_{name}", {}).get("calls", 0) for name in ("evalsha", "eval"))


def test_one_round_trip_takes_many_messages_and_holds_them_all(channel: Any, redis_url: str) -> None:
    chan, received, client = channel
    assert chan.fetch() == 0  # a fresh server answers a script's first call NOSCRIPT: load it here
    publish(redis_url, 40)
    before = evals(client)
    assert chan.fetch() == 40
    assert evals(client) - before == 1  # one script call took all 40
    assert len(received) == 40 and client.llen(KEYS.queue("normal")) == 0
    tags = {m.delivery_tag for m in received}
    assert len(tags) == 40
    held = {tag.decode() for tag in client.hkeys(KEYS.unacked)}
    assert held == tags and client.zcard(KEYS.unacked_index) == 40


def test_the_fetch_takes_the_most_urgent_queue_first_and_obeys_per_queue_limits(
    channel: Any, redis_url: str
) -> None:
    chan, received, client = channel
    publish(redis_url, 5, "bulk")
    publish(redis_url, 5, "normal")
    publish(redis_url, 5, "high")
    chan.fetch_gate = lambda queues, room: [(q, 2 if q.endswith("bulk") else room) for q in queues]
    chan.fetch()
    queues = [m.delivery_info["routing_key"] for m in received]
    assert queues == ["batchwork.high"] * 5 + ["batchwork.normal"] * 5 + ["batchwork.bulk"] * 2


def test_a_large_prefetch_window_keeps_its_urgent_reserve_and_still_fetches(
    channel: Any, redis_url: str
) -> None:
    # The throttle keeps prefetch_count // 8 of the window for urgent messages. It must judge that against
    # the window's whole room, not one round trip's share of it: a window of 4096 (reserve 512) once
    # fetched nothing at all, as every round trip takes at most 256.
    chan, received, client = channel
    chan.qos.prefetch_count = 4096
    holdings = Holdings()
    holdings.hold(JobSpec(str(uuid.uuid4()), "noop", "normal", 1), 1)  # one-item messages seen
    priority_of = {KEYS.queue("normal"): "normal", KEYS.queue("bulk"): "bulk"}
    chan.fetch_gate = FetchThrottle(holdings, 50_000, priority_of, reserve=512, stalled_s=lambda: 0.0)
    publish(redis_url, 300)
    assert chan.fetch() == 256 and chan.fetch() == 44


def test_a_busy_event_loop_comes_back_at_once_not_after_a_second(redis_url: str) -> None:
    # kombu's hub fires at most 10 due timers per turn and then polls for a whole second: a worker whose
    # fetch and ack timers were always due stalled a second at a time while messages waited.
    connection = Connection(redis_url, transport=TRANSPORT)
    hub = Hub()
    try:
        connection.transport.register_with_event_loop(connection.connection, hub)
        for _ in range(12):
            hub.call_later(0, lambda: None)
        assert hub.fire_timers() <= 0.01
    finally:
        hub.close()
        connection.release()


def test_acks_and_lease_renewals_cover_every_held_message_in_one_round_trip(
    channel: Any, redis_url: str
) -> None:
    chan, received, client = channel
    publish(redis_url, 10)
    chan.fetch()
    tags = [m.delivery_tag for m in received]
    client.zadd(KEYS.unacked_index, dict.fromkeys(tags, 0))  # leases long expired
    chan.renew_leases(tags[:7])
    scores = dict(client.zrange(KEYS.unacked_index, 0, -1, withscores=True))
    assert sorted(tag.decode() for tag, score in scores.items() if score > time.time() - 60) == sorted(
        tags[:7]
    )
    chan.qos.ack_many(tags[:7])
    assert sorted(t.decode() for t in client.hkeys(KEYS.unacked)) == sorted(tags[7:])
    chan.renew_leases(tags)  # renewing acked messages never brings them back
    assert client.zcard(KEYS.unacked_index) == 3


def test_expired_leases_come_back_once_each_without_a_lock(channel: Any, redis_url: str) -> None:
    chan, received, client = channel
    publish(redis_url, 200)
    chan.fetch()
    client.set("unacked_mutex", "left by a killed kombu worker", ex=300)  # would stop kombu's sweep
    client.zadd(KEYS.unacked_index, dict.fromkeys(client.hkeys(KEYS.unacked), 0))  # leases long run out
    others = [
        Connection(redis_url, transport=TRANSPORT, transport_options={"visibility_timeout": 1})
        for _ in range(3)
    ]
    sweeps = [threading.Thread(target=c.channel().qos.restore_visible) for c in others]
    for sweep in sweeps:
        sweep.start()
    chan.qos.restore_visible()
    for sweep in sweeps:
        sweep.join()
    for other in others:
        other.release()
    assert client.llen(KEYS.queue("normal")) == 200  # every message back, none twice
    assert client.hlen(KEYS.unacked) == 0
    counts = client.hvals(KEYS.lost)
    assert len(counts) == 200 and set(counts) == {b"1"}  # each counted as lost once


def test_a_worker_killed_right_after_a_fetch_loses_nothing(redis_url: str) -> None:
    publish(redis_url, 30)
    code = (
        "import os, sys\n"
        "from kombu import Connection\n"
        f"c = Connection({redis_url!r}, transport={TRANSPORT!r})\n"
        "ch = c.channel()\n"
        "ch.basic_consume('batchwork.normal', no_ack=False, callback=lambda m: None, consumer_tag='t')\n"
        "print(ch.fetch(), flush=True)\n"
        "os.kill(os.getpid(), 9)\n"
    )
    killed = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert killed.returncode == -9 and killed.stdout.strip() == "30"
    client = redis.Redis.from_url(redis_url)
    assert client.llen(KEYS.queue("normal")) == 0 and client.hlen(KEYS.unacked) == 30  # held, not lost
    client.zadd(KEYS.unacked_index, dict.fromkeys(client.hkeys(KEYS.unacked), 0))  # its leases run out
    survivor = Connection(redis_url, transport=TRANSPORT, transport_options={"visibility_timeout": 1})
    survivor.channel().qos.restore_visible()
    survivor.release()
    assert client.llen(KEYS.queue("normal")) == 30
    client.close()


def test_a_closing_channel_hands_back_what_it_holds_without_counting_it_lost(redis_url: str) -> None:
    publish(redis_url, 12)
    connection = Connection(redis_url, transport=TRANSPORT)
    chan = connection.channel()
    received: list[Any] = []
    chan.basic_consume("batchwork.normal", no_ack=False, callback=received.append, consumer_tag="t")
    chan.fetch()
    chan.qos.ack_many([m.delivery_tag for m in received[:4]])
    chan.close()  # what a worker does at SIGTERM
    connection.release()
    client = redis.Redis.from_url(redis_url)
    assert client.llen(KEYS.queue("normal")) == 8 and client.hlen(KEYS.unacked) == 0
    assert client.hlen(KEYS.lost) == 0
    client.close()


def test_a_pushed_value_that_is_no_message_is_dropped_not_held(channel: Any, redis_url: str) -> None:
    chan, received, client = channel
    client.lpush(KEYS.queue("normal"), b"\x00not json")
    publish(redis_url, 1)
    assert chan.fetch() == 2
    assert len(received) == 1 and client.hlen(KEYS.unacked) == 1


def test_infer_delay_writes_one_message_and_one_job_record_in_one_round_trip_and_no_sql(
    producer: dict[str, str], redis_url: str
) -> None:
    from sqlalchemy import Engine, event

    from worker.client import Client
    from worker.settings import get_settings
    from worker.tasks import infer

    statements: list[str] = []
    client = redis.Redis.from_url(redis_url)

    def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        statements.append(statement)

    event.listen(Engine, "before_cursor_execute", count)
    try:
        infer.delay(model="noop", inputs=["warm up"])  # connections and imports, not counted
        before = client.info("commandstats")
        statements.clear()
        job = infer.delay(model="noop", inputs=["one item"])
        after = client.info("commandstats")
    finally:
        event.remove(Engine, "before_cursor_execute", count)
    calls = {
        name.removeprefix("cmdstat_"): after[name]["calls"] - before.get(name, {"calls": 0})["calls"]
        for name in after
        if after[name]["calls"] != before.get(name, {"calls": 0})["calls"]
    }
    calls.pop("info", None)
    # One script call (its writes are counted too); the ZADD indexes the record for the census of messages
    # (lost jobs).
    assert calls == {"evalsha": 1, "hset": 1, "expire": 1, "zadd": 1, "lpush": 1}
    assert statements == []  # the producer writes no SQL
    assert Client(get_settings()).status(job.id).state == "queued"
    client.close()
