"""An input that kills the worker process itself (here ``os._exit``, as a segfault or the OOM killer would)
is run at most BATCHWORK_MAX_DELIVERIES times, then stored as an error; the rest of its job succeeds."""

from __future__ import annotations

import time

import pytest

from tests.integration.processes import WorkerProcess, produce, service_env
from worker.store.results import ResultStore

CRASH = "tests.support.models:Crash"


@pytest.mark.slow
def test_an_item_that_kills_its_worker_fails_alone_after_the_delivery_cap(
    redis_url: str, pg_url: str, pg_store: ResultStore
) -> None:
    env = service_env(
        redis_url,
        pg_url,
        visibility_timeout_s="4",
        max_deliveries="3",
        batching={CRASH: {"max_batch_size": 8, "max_wait_ms": 20}},
    )
    inputs = [f"text {i}" for i in range(30)]
    inputs[17] = "crash"
    worker, deaths = WorkerProcess(env, "crash0@test"), 0
    try:
        worker.wait_ready()
        [job_id] = produce(env, [{"via": "submit", "model": CRASH, "inputs": inputs}])
        deadline = time.monotonic() + 240
        while (status := pg_store.status(job_id)) is None or status.finished_at is None:
            assert time.monotonic() < deadline, f"job unfinished after {deaths} deaths: {status}"
            if worker.proc.poll() is not None:  # a supervisor's job: start a new worker
                deaths += 1
                assert deaths <= 3, "the poison input crashed a worker more often than the cap allows"
                worker.stop()  # reaped, its log pipe closed
                worker = WorkerProcess(env, f"crash{deaths}@test")
            time.sleep(0.1)
    finally:
        worker.stop()
    assert deaths == 3
    assert (status.state, status.done, status.failed) == ("partial", 29, 1)
    results = {r.index: r for r in pg_store.results(job_id)}
    assert results[17].error is not None and "died 3 times" in results[17].error
    assert "BATCHWORK_MAX_DELIVERIES=3" in results[17].error
    assert all(results[i].output == len(inputs[i]) for i in range(30) if i != 17)
    assert status.errors == ((results[17].error, 1),)
