"""Jobs whose messages vanished end as lost, whatever removed them; jobs whose messages remain never do.

A worker serves only the high queue, so the normal queue's messages wait; the test removes some of them (as
`celery purge` does, or one message at a time) and watches the jobs end, on SQLite and PostgreSQL, for jobs
from ``client.submit`` (a SQL row first) and from ``infer.delay`` (a Redis record until a worker takes it).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.integration.processes import ROOT, CommandProcess, produce, service_env, wait_until
from worker.broker.keys import Keys
from worker.store.results import ResultStore
from worker.store.values import FINISHED_STATES

GRACE_S = 2


class HighOnlyWorker(CommandProcess):
    ready_line = "batchwork engine ready"

    def __init__(self, env: dict[str, str]) -> None:
        super().__init__(env, "worker", "--loglevel=INFO", "--hostname", "high@test", "-Q", "batchwork.high")


@pytest.fixture
def deployment(redis_url: str, db_url: str) -> Iterator[dict[str, str]]:
    env = service_env(redis_url, db_url, lost_grace_s=str(GRACE_S))
    worker = HighOnlyWorker(env)
    try:
        assert worker.ready.wait(90), "\n".join(worker.log[-30:])
        yield env
    finally:
        worker.stop()


def _jobs(env: dict[str, str], count: int) -> list[str]:
    """``count`` jobs from each producer path, their messages waiting in the normal and bulk queues."""
    jobs: list[dict[str, Any]] = []
    for n in range(count):
        priority = ("normal", "bulk")[n % 2]
        inputs = [f"s{n}-{i}" for i in range(3)]
        jobs.append({"via": "submit", "model": "noop", "inputs": inputs, "priority": priority})
        jobs.append({"via": "delay", "model": "noop", "inputs": [f"d{n}"], "priority": priority})
    return produce(env, jobs)


def _status(store: ResultStore, client: redis.Redis, job_id: str) -> str:
    """The job's state: SQL's, or "pending" while only its Redis record knows it."""
    status = store.status(job_id)
    if status is not None:
        return status.state
    return "pending" if client.exists(Keys().job(job_id)) else "unknown"


def _remove_messages_of(client: redis.Redis, queue: str, job_ids: set[str]) -> int:
    removed = 0
    for message in client.lrange(queue, 0, -1):
        if any(job_id.encode() in message for job_id in job_ids):
            removed += client.lrem(queue, 1, message)
    return removed


@pytest.mark.slow
@pytest.mark.parametrize("removal", ["celery purge", "one message at a time"])
def test_jobs_whose_messages_vanished_end_lost_and_the_others_wait(
    deployment: dict[str, str], db_url: str, redis_url: str, removal: str
) -> None:
    env = deployment
    store = ResultStore.from_url(db_url)
    client = redis.Redis.from_url(redis_url)
    try:
        job_ids = _jobs(env, 3)
        keep = set(job_ids[::3])  # one of every three stays (submit and delay alike)
        gone = [job_id for job_id in job_ids if job_id not in keep]
        if removal == "celery purge":
            purged = subprocess.run(
                [sys.executable, "-m", "celery", "-A", "worker.celery_app", "purge", "-f"],
                env=env,
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert purged.returncode == 0, purged.stderr
            gone, keep = job_ids, set()
        else:
            queues = ("batchwork.normal", "batchwork.bulk")
            removed = sum(_remove_messages_of(client, queue, set(gone)) for queue in queues)
            assert removed == len(gone)

        def all_lost() -> bool:
            return all(_status(store, client, job_id) in FINISHED_STATES for job_id in gone)

        wait_until(all_lost, 60, lambda: f"states {[_status(store, client, j) for j in gone]}")
        for job_id in gone:
            status = store.status(job_id)
            assert status is not None and (status.state, status.done) == ("failed", 0)
            errors = [r.error for r in store.results(job_id)]
            assert len(errors) == status.total and all(e and e.startswith("lost: ") for e in errors)
            assert not client.exists(Keys().job(job_id))  # infer.delay's record went with it
        # Several census periods later, the jobs whose messages wait are still waiting, untouched (a span of
        # time is what this checks: nothing may happen in it).
        time.sleep(3 * GRACE_S)
        assert not client.hlen(Keys().lost_suspects)
        for job_id in keep:
            assert _status(store, client, job_id) in ("queued", "pending")
            assert list(store.results(job_id)) == []
    finally:
        store.close()
        client.close()


@pytest.mark.slow
def test_a_run_waiting_on_purged_messages_ends_with_every_line_lost(
    deployment: dict[str, str], redis_url: str, tmp_path: Path
) -> None:
    (tmp_path / "in.jsonl").write_text("".join(f'{{"text": "t{i}"}}\n' for i in range(5)))
    run = subprocess.Popen(
        [sys.executable, "-m", "worker.cli", "run", "in.jsonl", "-m", "noop", "-o", "out.jsonl"],
        cwd=tmp_path,
        env=deployment,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    client = redis.Redis.from_url(redis_url)
    try:
        wait_until(lambda: client.llen("batchwork.normal"), 60, lambda: "the run's message never queued")
        client.delete("batchwork.normal")  # what `celery purge` does to a queue
        _, err = run.communicate(timeout=60)
    finally:
        run.kill()
        client.close()
    assert run.returncode == 1, err
    lines = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [line["index"] for line in lines] == list(range(5))
    assert all(line["error"].startswith("lost: ") for line in lines)
