"""Flower, started as the README says, shows the batching worker and its tasks (Celery task events)."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest

from tests.integration.processes import ROOT, produce, service_env, wait_finished, workers
from tests.support.services import free_port
from worker.store.results import ResultStore


def poll_json(url: str, auth: tuple[str, str], accept, timeout_s: float = 60):
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            last = httpx.get(url, auth=auth, timeout=5).json()
            if accept(last):
                return last
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    raise AssertionError(f"{url} never showed what was expected; last answer: {last}")


@pytest.mark.slow
def test_flower_shows_the_batching_worker_and_its_tasks(
    redis_url: str, pg_url: str, pg_store: ResultStore
) -> None:
    env = service_env(redis_url, pg_url)
    port, auth = free_port(), ("admin", "s3cret")
    flower = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "worker.celery_app",
            "flower",
            f"--port={port}",
            "--address=127.0.0.1",
            f"--basic-auth={auth[0]}:{auth[1]}",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        with workers(env):
            [job_id] = produce(env, [{"via": "delay", "model": "noop", "inputs": ["hello", "flower"]}])
            wait_finished(pg_store, [job_id])
            base = f"http://127.0.0.1:{port}"
            workers_seen = poll_json(f"{base}/api/workers?refresh=1", auth, lambda w: "w0@test" in w)
            assert "w0@test" in workers_seen
            tasks = poll_json(
                f"{base}/api/tasks", auth, lambda t: t.get(job_id, {}).get("state") == "SUCCESS"
            )
            task = tasks[job_id]
            assert task["name"] == "batchwork.infer"
            assert task["worker"] == "w0@test"
            # Every event arrived, with its time: received <= started <= succeeded, and what the job did.
            assert 0 < task["received"] <= task["started"] <= task["succeeded"], task
            assert task["runtime"] >= 0 and "'items': 2, 'failed': 0" in task["result"], task
            assert "'model': 'noop'" in task["kwargs"], task
            assert httpx.get(f"{base}/api/tasks", timeout=5).status_code == 401  # auth is on
    finally:
        flower.terminate()
        flower.wait(10)
