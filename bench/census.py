"""The Redis time of one census of messages (lost jobs) by queue depth, on a redis-server of its own: the
normal queue filled with single-item messages as ``infer.delay`` writes them, then the census (median of 5)
with the 1000 oldest jobs wanted, a lost job (the whole queue read), a lost job of another priority, nothing.
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


def main() -> None:
    parser = h.arguments(__doc__)
    parser.add_argument("--messages", default="1000,10000,100000")
    args = parser.parse_args()
    table = []
    with RedisServer() as server:
        client, keys, url = redis.Redis.from_url(f"{server.url}/0"), Keys(), f"{server.url}/0"
        census = MessageCensus(client, keys, grace_s=60)

        def time_ms(wanted: list[tuple[str, str]]) -> float:
            runs = []
            for _ in range(5):
                client.delete(keys.lost_suspects)
                started = time.perf_counter()
                census.lost(wanted)
                runs.append((time.perf_counter() - started) * 1000)
            return statistics.median(runs)

        for count in [int(n) for n in args.messages.split(",")]:
            client.flushdb()
            publisher, ids = Publisher(url, keys, 512), []
            for _ in range(count):
                call = NewJob(str(uuid.uuid4()), "noop", ("some text of a few words",), "normal", 0, 1, None)
                publisher.enqueue(call, task_id=call.job_id)
                ids.append(call.job_id)
            lost = [[(str(uuid.uuid4()), priority)] for priority in ("normal", "bulk")]
            table.append([count, time_ms([(job_id, "normal") for job_id in ids[:1000]]), *map(time_ms, lost),
                          time_ms([])])  # fmt: skip
        client.close()
    h.print_table(["queued", "oldest 1000 seen ms", "whole queue read ms", "lost in another queue ms",
                   "nothing wanted ms"], table)  # fmt: skip


if __name__ == "__main__":
    main()
