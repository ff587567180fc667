"""Chaos on real Redis and PostgreSQL: workers SIGKILLed mid-batch lose nothing and duplicate nothing."""

from __future__ import annotations

import json
import random
import re
import time

import pytest
from sqlalchemy import func, select

from tests.integration.processes import WorkerProcess, produce, service_env, wait_finished
from worker.store import tables
from worker.store.results import ResultStore

JOBS, ITEMS_PER_JOB = 5, 2_000
ALREADY_STORED = re.compile(r"(\d+) of \d+ outcomes were already stored")


def run_jobs(env: dict[str, str], store: ResultStore, kill_every_s: float | None) -> dict[str, float]:
    inputs = [[f"job {j} item {i}" for i in range(ITEMS_PER_JOB)] for j in range(JOBS)]
    rng = random.Random(4)
    procs = [WorkerProcess(env, f"chaos{i}@test") for i in range(3)]
    kills, retired = 0, []
    try:
        for proc in procs:
            proc.wait_ready()
        started = time.monotonic()
        job_ids = produce(env, [{"via": "submit", "model": "simulated", "inputs": texts} for texts in inputs])
        last_kill = time.monotonic()
        while not _all_finished(store, job_ids):
            assert time.monotonic() - started < 240, "the jobs did not finish under chaos"
            if kill_every_s is not None and time.monotonic() - last_kill >= kill_every_s:
                victim = rng.randrange(len(procs))
                procs[victim].proc.kill()  # SIGKILL: no shutdown, no acks, no cleanup
                retired.append(procs[victim])
                procs[victim] = WorkerProcess(env, f"chaos{victim}-{kills}@test")
                kills += 1
                last_kill = time.monotonic()
            time.sleep(0.2)
        elapsed = time.monotonic() - started
    finally:
        for proc in procs:
            proc.stop()
    statuses = wait_finished(store, job_ids, timeout_s=5)
    for job_id, texts, status in zip(job_ids, inputs, statuses, strict=True):
        assert (status.state, status.done, status.failed) == ("succeeded", ITEMS_PER_JOB, 0)
        results = list(store.results(job_id))
        assert [r.index for r in results] == list(range(ITEMS_PER_JOB))  # none missing
        assert [r.output for r in results] == [len(t) for t in texts]  # none wrong
    with store.engine.connect() as conn:
        rows = conn.scalar(select(func.count()).select_from(tables.results))
    assert rows == JOBS * ITEMS_PER_JOB  # none duplicated
    logs = [line for proc in procs + retired for line in proc.log]
    redelivered = sum(int(m.group(1)) for line in logs if (m := ALREADY_STORED.search(line)))
    return {
        "items": JOBS * ITEMS_PER_JOB,
        "kills": kills,
        "redelivered_items": redelivered,
        "seconds": elapsed,
    }


def _all_finished(store: ResultStore, job_ids: list[str]) -> bool:
    return all(store.status(job_id).finished_at is not None for job_id in job_ids)


@pytest.mark.slow
def test_sigkilled_workers_lose_nothing_and_duplicate_nothing(
    redis_url: str, pg_url: str, pg_store: ResultStore
) -> None:
    store = pg_store
    env = service_env(
        redis_url,
        pg_url,
        visibility_timeout_s="6",
        submit_chunk_size="100",
        max_held_items="1000",
        # 20 ms + 2 ms an item: about 430 items/s a worker, so the run lasts long enough to kill into.
        simulated_base_ms="20",
        simulated_per_item_ms="2",
        batching={"simulated": {"max_batch_size": 64, "max_wait_ms": 10}},
        # A worker killed every 2 s can be killed three times while running the same innocent item, which
        # the default delivery cap (3) would take for a poison input; churn like this wants a higher cap.
        max_deliveries="20",
    )
    calm = run_jobs(env, store, kill_every_s=None)
    with store.engine.begin() as conn:
        conn.execute(tables.results.delete())
        conn.execute(tables.jobs.delete())
    chaos = run_jobs(env, store, kill_every_s=2.0)
    assert chaos["kills"] >= 3
    print("\nchaos figures:", json.dumps({"no kills": calm, "with kills": chaos}))


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
    first = WorkerProcess(env, "term@test")
    first.wait_ready()
    [job_id] = produce(env, [{"via": "submit", "model": "simulated", "inputs": ["z"] * 1000}])
    while store.status(job_id).done < 100:
        time.sleep(0.05)
    stopped = time.monotonic()
    first.stop(timeout_s=30)  # SIGTERM
    assert first.proc.returncode == 0
    assert time.monotonic() - stopped < 10  # it did not run the 900 items it held before exiting
    held_back = store.status(job_id).done
    assert held_back < 1000
    second = WorkerProcess(env, "after@test")
    try:
        second.wait_ready()
        [status] = wait_finished(store, [job_id], timeout_s=60)
    finally:
        second.stop()
    assert (status.state, status.done) == ("succeeded", 1000)
