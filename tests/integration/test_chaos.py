"""Chaos on real Redis and PostgreSQL: workers SIGKILLed mid-batch lose nothing and duplicate nothing."""

from __future__ import annotations

import base64
import json
import random
import re
import time

import pytest
import redis
from sqlalchemy import func, select

from tests.integration.processes import WorkerProcess, produce, service_env, wait_finished, wait_until
from worker.broker.keys import Keys
from worker.store import tables
from worker.store.results import ResultStore

JOBS, ITEMS_PER_JOB = 4, 500
VISIBILITY_TIMEOUT_S, RESTORE_SWEEP_S = 6, 2  # the test's lease; kombu's restore timer (celery_app.py)
KEYS = Keys("batchwork")
ALREADY_STORED = re.compile(r"(\d+) of \d+ outcomes were already stored")
HANDED_BACK = re.compile(r"handed back (\d+) messages whose worker stopped renewing their lease")


class Fleet:
    """Three workers, one of which a supervisor replaces whenever it is SIGKILLed."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.procs = [WorkerProcess(env, f"chaos{i}@test") for i in range(3)]
        self.retired: list[WorkerProcess] = []
        self.rng = random.Random(4)
        for proc in self.procs:
            proc.wait_ready()

    def kill_one(self) -> None:
        victim = self.rng.randrange(len(self.procs))
        self.procs[victim].proc.kill()  # SIGKILL: no shutdown, no acks, no cleanup
        self.retired.append(self.procs[victim])
        self.procs[victim] = WorkerProcess(self.env, f"chaos{victim}-{len(self.retired)}@test")

    def count(self, pattern: re.Pattern[str]) -> int:
        logs = [line for proc in self.procs + self.retired for line in proc.log]
        return sum(int(m.group(1)) for line in logs if (m := pattern.search(line)))

    def stop(self) -> None:
        for proc in self.procs + self.retired:  # the killed ones too: reaped, their log pipes closed
            proc.stop()


def run_round(
    fleet: Fleet, store: ResultStore, kills: int, kill_every_s: float, bound_s: float
) -> dict[str, float]:
    """Submit the jobs, SIGKILL a worker every ``kill_every_s`` (``kills`` times), and check that every job
    then finishes within ``bound_s`` of the last kill with every item exactly once and right."""
    inputs = [[f"job {j} item {i}" for i in range(ITEMS_PER_JOB)] for j in range(JOBS)]
    started = time.monotonic()
    job_ids = produce(
        fleet.env, [{"via": "submit", "model": "simulated", "inputs": texts} for texts in inputs]
    )
    last_kill = started
    for _ in range(kills):
        while time.monotonic() - last_kill < kill_every_s:
            assert not _all_finished(store, job_ids), "the jobs finished before the kills: slow them down"
            time.sleep(0.1)
        fleet.kill_one()
        last_kill = time.monotonic()
    while not _all_finished(store, job_ids):
        assert time.monotonic() - last_kill < bound_s, f"jobs unfinished {bound_s:.0f} s after the last kill"
        time.sleep(0.2)
    finished = time.monotonic()
    for job_id, texts, status in zip(
        job_ids, inputs, wait_finished(store, job_ids, timeout_s=5), strict=True
    ):
        assert (status.state, status.done, status.failed) == ("succeeded", ITEMS_PER_JOB, 0)
        results = list(store.results(job_id))
        assert [r.index for r in results] == list(range(ITEMS_PER_JOB))  # none missing
        assert [r.output for r in results] == [len(t) for t in texts]  # none wrong
    return {"seconds": finished - started, "after_last_kill_s": finished - last_kill}


def _all_finished(store: ResultStore, job_ids: list[str]) -> bool:
    return all((s := store.status(job_id)) is not None and s.finished_at is not None for job_id in job_ids)


@pytest.mark.slow
def test_sigkilled_workers_lose_nothing_and_duplicate_nothing_and_recover_in_bounded_time(
    redis_url: str, pg_url: str, pg_store: ResultStore
) -> None:
    store = pg_store
    env = service_env(
        redis_url,
        pg_url,
        visibility_timeout_s=str(VISIBILITY_TIMEOUT_S),
        submit_chunk_size="50",
        max_held_items="200",
        # 300 ms + 10 ms an item: a batch of 32 runs 0.6 s, so a kill lands mid-batch.
        simulated_base_ms="300",
        simulated_per_item_ms="10",
        batching={"simulated": {"max_batch_size": 32, "max_wait_ms": 10}},
        # A worker killed every 3 s can be killed three times while running the same innocent item, which
        # the default delivery cap (3) would take for a poison input; churn like this wants a higher cap,
        # under which a batch that died once runs again as a batch (hooks/journal.py, ALONE_AFTER).
        max_deliveries="20",
    )
    fleet = Fleet(env)
    try:
        calm = run_round(fleet, store, kills=0, kill_every_s=0, bound_s=120)
        # A killed worker's messages return within one lease and a sweep; a few sweeps of slack, and the
        # time the remaining work takes (at most a calm run's).
        bound_s = VISIBILITY_TIMEOUT_S + 3 * RESTORE_SWEEP_S + calm["seconds"]
        rounds = [run_round(fleet, store, kills=3, kill_every_s=3.0, bound_s=bound_s) for _ in range(2)]
    finally:
        fleet.stop()
    with store.engine.connect() as conn:
        rows = conn.scalar(select(func.count()).select_from(tables.results))
    assert rows == 3 * JOBS * ITEMS_PER_JOB  # none duplicated
    handed_back = fleet.count(HANDED_BACK)
    assert handed_back > 0, "no kill landed while a worker held messages"
    figures = {
        "calm": calm,
        "rounds": rounds,
        "kills": len(fleet.retired),
        "messages_handed_back": handed_back,
        "outcomes_stored_again": fleet.count(ALREADY_STORED),
        "bound_s": bound_s,
    }
    print("\nchaos figures:", json.dumps(figures))


def offset_of(raw: bytes) -> int:
    """The offset of a waiting message's first item (Celery's envelope, body in base64)."""
    envelope = json.loads(raw)
    _args, kwargs, _embed = json.loads(base64.b64decode(envelope["body"]))
    return int(kwargs["offset"])


@pytest.mark.slow
def test_sigterm_stops_after_the_batch_in_flight_and_hands_back_the_rest(
    redis_url: str, pg_url: str, pg_store: ResultStore
) -> None:
    store = pg_store
    env = service_env(
        redis_url,
        pg_url,
        simulated_base_ms="50",
        simulated_per_item_ms="0",
        submit_chunk_size="50",
        batching={"simulated": {"max_batch_size": 20, "max_wait_ms": 10}},
    )
    broker = redis.Redis.from_url(redis_url)
    first = WorkerProcess(env, "term@test")
    first.wait_ready()
    [job_id] = produce(env, [{"via": "submit", "model": "simulated", "inputs": ["z"] * 1000}])
    wait_until(lambda: store.status(job_id).done >= 100, 60, lambda: "100 items before the SIGTERM")
    wait_until(lambda: broker.hlen(KEYS.unacked), 30, lambda: "the worker held no message")
    first.stop(timeout_s=30)  # SIGTERM
    assert first.proc.returncode == 0
    # What it held is in its queue again, at once (not after a lease): nothing held, and every item not stored
    # is in a waiting message. Messages are 50 items from offset 0, 50, ...
    assert broker.hlen(KEYS.unacked) == 0 and broker.zcard(KEYS.unacked_index) == 0
    waiting = {offset_of(raw) for raw in broker.lrange(KEYS.queue("normal"), 0, -1)}
    stored = {outcome.index for outcome in store.results(job_id)}
    assert len(stored) < 1000  # it did not run the items it held before exiting
    unstored_chunks = {index - index % 50 for index in set(range(1000)) - stored}
    assert unstored_chunks <= waiting, sorted(unstored_chunks - waiting)
    broker.close()
    second = WorkerProcess(env, "after@test")
    try:
        second.wait_ready()
        [status] = wait_finished(store, [job_id], timeout_s=60)
    finally:
        second.stop()
    assert (status.state, status.done) == ("succeeded", 1000)
