"""Outages of the database and the broker mid-run: nothing stored is lost, every item still ends."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
from sqlalchemy.engine import make_url

from tests.integration.processes import produce, service_env, wait_finished, wait_until, workers
from tests.integration.tcp_proxy import TcpProxy
from tests.support.services import free_port
from worker.store.results import ResultStore

SLOW_SIMULATED = {
    "simulated_base_ms": "50",
    "simulated_per_item_ms": "0",
    "batching": {"simulated": {"max_batch_size": 20, "max_wait_ms": 10}},
}


@pytest.mark.slow
def test_a_database_outage_mid_run_loses_nothing(redis_url: str, pg_url: str, pg_store: ResultStore) -> None:
    store = pg_store
    url = make_url(pg_url)
    proxy = TcpProxy(url.host or "127.0.0.1", url.port or 5432)
    through_proxy = url.set(port=proxy.port).render_as_string(hide_password=False)
    env = service_env(redis_url, through_proxy, **SLOW_SIMULATED)
    try:
        with workers(env) as [worker]:
            [job_id] = produce(env, [{"via": "submit", "model": "simulated", "inputs": ["x"] * 1000}])
            wait_until(lambda: store.status(job_id).done >= 100, 60, lambda: "100 items before the outage")
            proxy.cut()  # the worker's database connections drop and new ones are refused
            wait_until(
                lambda: any("retrying" in line for line in worker.log),
                60,
                lambda: "the worker never said it was retrying:\n" + "\n".join(worker.log[-20:]),
            )
            done_during_outage = store.status(job_id).done  # read directly, not through the proxy
            proxy.restore()
            [status] = wait_finished(store, [job_id], timeout_s=90)
    finally:
        proxy.close()
    assert (status.state, status.done) == ("succeeded", 1000)
    assert done_during_outage < 1000  # the outage really held the work up
    assert any("retrying" in line for line in worker.log)
    assert sorted(r.index for r in store.results(job_id)) == list(range(1000))


def start_redis(port: int, workdir: Path) -> subprocess.Popen[bytes]:
    redis = subprocess.Popen(
        [
            shutil.which("redis-server") or "redis-server",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(workdir),
        ],
        stdout=subprocess.DEVNULL,
    )
    for _ in range(100):
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return redis
        time.sleep(0.05)
    raise AssertionError("redis-server did not start")


@pytest.mark.slow
def test_a_broker_restart_that_loses_the_queue_still_ends_every_item(
    pg_url: str, pg_store: ResultStore, tmp_path: Path
) -> None:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    store = pg_store
    port = free_port()
    redis = start_redis(port, tmp_path)  # a Redis of this test's own, since it gets killed
    env = service_env(
        f"redis://127.0.0.1:{port}/0",
        pg_url,
        lost_grace_s="3",
        max_held_items="200",
        submit_chunk_size="50",
        **SLOW_SIMULATED,
    )
    try:
        with workers(env):
            job_ids = produce(env, [{"via": "submit", "model": "simulated", "inputs": ["y"] * 600}] * 2)
            wait_until(lambda: store.status(job_ids[0]).done >= 60, 60, lambda: "60 items before the restart")
            redis.kill()  # SIGKILL, nothing on disk: every queued message is gone
            redis.wait()
            time.sleep(1)
            redis = start_redis(port, tmp_path)
            statuses = wait_finished(store, job_ids, timeout_s=90)
    finally:
        redis.kill()
        redis.wait()
    for job_id, status in zip(job_ids, statuses, strict=True):
        assert status.done + status.failed == 600  # every item ended
        results = list(store.results(job_id))
        assert [r.index for r in results] == list(range(600))  # exactly once each
        lost = [r for r in results if r.error]
        assert all(r.error.startswith("lost:") for r in lost)
    assert sum(s.failed for s in statuses) > 0  # the restart really dropped queued items
    assert sum(s.done for s in statuses) >= 60
