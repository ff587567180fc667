"""One home per job, on Redis and PostgreSQL: a job from ``infer.delay`` is a Redis record until a worker
stores its first item, and while it is, every surface (the Python client, Celery's result API, the HTTP API
with an admin key, its listing, `batchwork status`) reads it the same: queued. Then it is a SQL row, and the
record is gone."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from celery import states
from fastapi.testclient import TestClient

from tests.integration.processes import batchwork, wait_finished, workers
from worker.broker.keys import Keys
from worker.store.api_keys import KeyStore
from worker.store.results import ResultStore


@pytest.fixture
def http(producer: dict[str, str], pg_store: ResultStore) -> Iterator[tuple[TestClient, dict[str, str]]]:
    """The HTTP API in this process, and a header for an admin key and for another tenant's key."""
    from api.app import create_app
    from worker.settings import Settings

    keys = KeyStore(pg_store.engine)
    admin, alice = keys.create("ops", admin=True)[1], keys.create("alice")[1]
    with TestClient(create_app(Settings(api_check_processes=0))) as client:
        yield client, {"admin": f"Bearer {admin}", "alice": f"Bearer {alice}"}


@pytest.mark.slow
def test_a_delayed_job_reads_queued_everywhere_until_a_worker_moves_it_to_sql(
    producer: dict[str, str],
    pg_store: ResultStore,
    redis_url: str,
    http: tuple[TestClient, dict[str, str]],
    tmp_path: Path,
) -> None:
    from worker.client import Client
    from worker.settings import get_settings
    from worker.tasks import infer

    api, keys = http
    result = infer.delay(model="simulated", inputs=["abc", "de"])
    job_id = result.id
    record = Keys.of(get_settings()).job(job_id)
    broker = redis.Redis.from_url(redis_url)
    assert pg_store.status(job_id) is None and broker.exists(record)  # only Redis knows it

    assert Client(get_settings()).status(job_id).state == "queued"
    assert result.state == states.PENDING
    seen = api.get(f"/v1/jobs/{job_id}", headers={"Authorization": keys["admin"]})
    assert seen.status_code == 200, seen.text
    assert seen.json()["state"] == "queued" and seen.json()["counts"]["total"] == 2
    assert api.get(f"/v1/jobs/{job_id}", headers={"Authorization": keys["alice"]}).status_code == 404
    listed = api.get("/v1/jobs", headers={"Authorization": keys["admin"]}).json()["jobs"]
    assert [(job["id"], job["state"]) for job in listed] == [(job_id, "queued")]
    assert api.get("/v1/jobs", headers={"Authorization": keys["alice"]}).json()["jobs"] == []
    shown = batchwork(tmp_path, "status", job_id, env=producer, timeout_s=60)
    assert shown.returncode == 0, shown.stderr
    assert "queued" in shown.stdout

    with workers(producer):
        [job] = wait_finished(pg_store, [job_id], timeout_s=60)
    assert job.state == "succeeded" and not broker.exists(record)
    assert result.get(timeout=5) == [3, 2] and result.state == states.SUCCESS
    done = api.get(f"/v1/jobs/{job_id}", headers={"Authorization": keys["admin"]}).json()
    assert done["state"] == "succeeded" and done["counts"]["done"] == 2


def test_an_admin_cancels_a_delayed_job_before_any_worker_took_it(
    producer: dict[str, str], pg_store: ResultStore, http: tuple[TestClient, dict[str, str]]
) -> None:
    from worker.tasks import infer

    api, keys = http
    job_id = infer.delay(model="simulated", inputs=["abc"]).id
    cancelled = api.post(f"/v1/jobs/{job_id}/cancel", headers={"Authorization": keys["admin"]})
    assert cancelled.status_code == 200, cancelled.text
    assert cancelled.json()["state"] == "cancelled"
    status = pg_store.status(job_id)
    assert status is not None and status.state == "cancelled" and status.tenant == "default"
