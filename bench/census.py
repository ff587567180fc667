"""What the census of messages (lost jobs) costs Redis: one script call per period, its time growing with the
messages it reads before it has seen every unfinished job.

    python -m bench.census [--messages 1000,10000,100000]

On a redis-server of its own (tests/support/services.py). For each queue depth it fills
the normal queue with single-item messages as ``infer.delay`` writes them (each its own job), then times the
census script (median of 5) in four cases: every unfinished job seen near the queue's oldest end (the 1000
oldest jobs wanted: the common case, a backlog draining), every message read (one wanted job of that
priority has no message: the whole queue is read), a lost job of another priority (its own, empty, queue is
read), and nothing to look for. Prints milliseconds of Redis time per census.
"""

from __future__ import annotations

import statistics
import time
import uuid

import redis

from bench import harness as h
from tests.support.services import RedisServer
from worker.broker.census import MessageCensus
from worker.broker.keys import Keys
from worker.broker.producer import Publisher
from worker.calls import NewJob


def _fill(url: str, keys: Keys, count: int) -> list[str]:
    publisher = Publisher(url, keys, 512)
    ids = []
    for _ in range(count):
        call = NewJob(str(uuid.uuid4()), "noop", ("some text of a few words",), "normal", 0, 1, None)
        publisher.enqueue(call, task_id=call.job_id)
        ids.append(call.job_id)
    return ids


def _time_ms(census: MessageCensus, wanted: list[tuple[str, str]], client: redis.Redis, keys: Keys) -> float:
    runs = []
    for _ in range(5):
        client.delete(keys.lost_suspects)
        started = time.perf_counter()
        census.lost(wanted)
        runs.append((time.perf_counter() - started) * 1000)
    return statistics.median(runs)


def main() -> None:
    parser = h.arguments(__doc__)
    parser.add_argument("--messages", default="1000,10000,100000")
    args = parser.parse_args()
    with RedisServer() as server:
        measure(f"{server.url}/0", [int(n) for n in args.messages.split(",")])


def measure(url: str, counts: list[int]) -> None:
    client = redis.Redis.from_url(url)
    keys = Keys()
    census = MessageCensus(client, keys, grace_s=60)
    table = []
    try:
        for count in counts:
            client.flushdb()
            ids = _fill(url, keys, count)
            oldest = _time_ms(census, [(job_id, "normal") for job_id in ids[:1000]], client, keys)
            whole = _time_ms(census, [(str(uuid.uuid4()), "normal")], client, keys)
            other = _time_ms(census, [(str(uuid.uuid4()), "bulk")], client, keys)
            table.append([count, oldest, whole, other, _time_ms(census, [], client, keys)])
    finally:
        client.close()
    h.print_table(["queued", "oldest 1000 seen ms", "whole queue read ms", "lost in another queue ms",
                   "nothing wanted ms"], table)  # fmt: skip


if __name__ == "__main__":
    main()
