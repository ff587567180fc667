"""The HTTP API's keys, limits and metrics through real HTTP: 401 for missing, wrong and revoked keys; 413,
429 and 503 each provoked for real; Prometheus metrics from workers and the API.
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import uuid

import httpx
import pytest
import redis
from sqlalchemy import text

from tests.integration.api_server import (
    ApiProcess,
    Tenant,
    api_server,
    free_port,
    make_key,
    ndjson_chunks,
    scrape,
    wait_until,
)
from tests.integration.processes import service_env, workers
from worker.store.db import make_engine
from worker.store.results import ResultStore

ECHO = "tests.support.models:Echo"
POISON = "tests.support.models:Poison"
QUEUES = ("batchwork.high", "batchwork.normal", "batchwork.bulk")


ECHO = "tests.support.models:Echo"
QUEUES = ("batchwork.high", "batchwork.normal", "batchwork.bulk")


@pytest.fixture
def env(redis_url: str, pg_url: str, pg_store: ResultStore) -> dict[str, str]:
    return service_env(redis_url, pg_url, metrics_port=0)


@pytest.mark.slow
def test_missing_wrong_and_revoked_keys_are_401(env: dict[str, str]) -> None:
    url = env["BATCHWORK_DATABASE_URL"]
    alice = make_key(url, "alice")
    with api_server(env) as api, api_server(env) as other:
        bare = httpx.Client(base_url=api.url)
        for route in ("/v1/jobs", "/v1/models", "/v1/jobs/x", "/v1/jobs/x/results"):
            assert bare.get(route).status_code == 401
        assert bare.post("/v1/jobs", json={"model": ECHO, "inputs": ["x"]}).status_code == 401
        assert Tenant(api.url, "bw_not-a-key").http.get("/v1/jobs").status_code == 401
        assert bare.get("/v1/jobs", headers={"Authorization": f"Basic {alice}"}).status_code == 401
        clients = [Tenant(api.url, alice).http, Tenant(other.url, alice).http]
        for client in clients:  # each API process has just found the key live
            answer = client.get("/v1/models")
            assert answer.status_code == 200
            assert "simulated" in {model["name"] for model in answer.json()}

        listed = subprocess.run(
            [sys.executable, "-m", "worker.cli", "keys", "list"], env=env, capture_output=True, text=True
        )
        [key_id] = re.findall(r"\b([0-9a-f]{16})\b.*alice", listed.stdout)
        revoked = subprocess.run(
            [sys.executable, "-m", "worker.cli", "keys", "revoke", key_id],
            env=env,
            capture_output=True,
            text=True,
        )
        assert revoked.returncode == 0, revoked.stderr
        # Revoked at once: the very next request to either process is refused, with no wait.
        for client in clients:
            answer = client.get("/v1/jobs")
            assert answer.status_code == 401
            assert answer.headers["www-authenticate"] == "Bearer"
            assert "\n" not in answer.json()["detail"]
        assert bare.get("/healthz").json() == {"status": "ok", "broker": "ok", "database": "ok"}


def test_keys_create_prints_a_key_once_and_stores_only_its_hash(sqlite_url: str) -> None:
    env = service_env("redis://127.0.0.1:1/0", sqlite_url)  # needs no broker (none listens on 1)
    created = subprocess.run(
        [sys.executable, "-m", "worker.cli", "keys", "create", "--tenant", "alice"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert created.returncode == 0, created.stderr
    key = created.stdout.strip()
    assert key.startswith("bw_") and len(key) > 40
    engine = make_engine(sqlite_url)
    with engine.connect() as conn:
        stored = conn.execute(text("SELECT * FROM api_keys")).one()._mapping
    engine.dispose()
    assert key not in {str(value) for value in stored.values()}
    assert stored["key_sha256"] == hashlib.sha256(key.encode()).hexdigest()
    refused = subprocess.run(
        [sys.executable, "-m", "worker.cli", "keys", "create", "--tenant", "default"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert refused.returncode == 2
    assert "any admin key (--admin) sees them" in " ".join(refused.stderr.split())
    assert "Traceback" not in refused.stderr


@pytest.mark.slow
def test_bodies_over_the_limit_are_413_whether_their_length_is_known_or_streamed(env: dict[str, str]) -> None:
    env = {**env, "BATCHWORK_API_MAX_BODY_BYTES": "2000", "BATCHWORK_API_MAX_NDJSON_BYTES": "50000"}
    alice = make_key(env["BATCHWORK_DATABASE_URL"], "alice")
    broker = redis.Redis.from_url(env["BATCHWORK_BROKER_URL"])
    with api_server(env) as api:
        client = Tenant(api.url, alice)
        answer = client.http.post("/v1/jobs", json={"model": ECHO, "inputs": ["x" * 100] * 30})
        assert answer.status_code == 413
        assert "BATCHWORK_API_MAX_BODY_BYTES" in answer.json()["detail"]
        big = [{"text": "y" * 90}] * 1000  # ~100 kB, sent chunked: no Content-Length to refuse it by
        answer = client.http.post(
            "/v1/jobs",
            params={"model": ECHO},
            content=ndjson_chunks(big),
            headers={"Content-Type": "application/x-ndjson"},
        )
        assert answer.status_code == 413
        assert client.submit(ECHO, ["small"])["counts"]["total"] == 1
        assert client.http.get("/v1/jobs").json()["jobs"][0]["counts"]["total"] == 1
    assert sum(broker.llen(queue) for queue in QUEUES) == 1


@pytest.mark.slow
def test_too_many_items_per_job_or_unfinished_for_the_tenant_is_429_with_retry_after(
    env: dict[str, str],
) -> None:
    env = {**env, "BATCHWORK_MAX_ITEMS_PER_JOB": "100", "BATCHWORK_API_MAX_TENANT_ITEMS": "150"}
    url = env["BATCHWORK_DATABASE_URL"]
    alice, bob = make_key(url, "alice"), make_key(url, "bob")
    with api_server(env) as api:  # no worker: submitted items stay unfinished
        client = Tenant(api.url, alice)
        answer = client.http.post("/v1/jobs", json={"model": ECHO, "inputs": ["x"] * 101})
        assert answer.status_code == 429
        assert answer.headers["retry-after"] == "10"
        answer = client.http.post(
            "/v1/jobs",
            params={"model": ECHO},
            content=ndjson_chunks(["x"] * 101, per_chunk=10),
            headers={"Content-Type": "application/x-ndjson"},
        )
        assert answer.status_code == 429
        assert "BATCHWORK_MAX_ITEMS_PER_JOB" in answer.json()["detail"]

        client.submit(ECHO, ["x"] * 100)
        answer = client.http.post("/v1/jobs", json={"model": ECHO, "inputs": ["x"] * 51})
        assert answer.status_code == 429
        assert "100 unfinished items" in answer.json()["detail"]
        assert answer.headers["retry-after"] == "10"
        client.submit(ECHO, ["x"] * 50)  # up to the bound is fine
        Tenant(api.url, bob).submit(ECHO, ["x"] * 100)  # another tenant has its own bound


@pytest.mark.slow
def test_a_full_broker_queue_is_503_with_retry_after(env: dict[str, str]) -> None:
    env = {**env, "BATCHWORK_API_MAX_QUEUE_DEPTH": "3", "BATCHWORK_SUBMIT_CHUNK_SIZE": "10"}
    alice = make_key(env["BATCHWORK_DATABASE_URL"], "alice")
    with api_server(env) as api:  # no worker: the messages stay in Redis
        client = Tenant(api.url, alice)
        client.submit(ECHO, ["x"] * 40)  # four messages
        for body in ({"json": {"model": ECHO, "inputs": ["x"]}}, {"content": b'"x"\n'}):
            headers = {} if "json" in body else {"Content-Type": "application/x-ndjson"}
            answer = client.http.post("/v1/jobs", params={"model": ECHO}, headers=headers, **body)  # type: ignore[arg-type]
            assert answer.status_code == 503
            assert answer.headers["retry-after"] == "10"
            assert "BATCHWORK_API_MAX_QUEUE_DEPTH" in answer.json()["detail"]


@pytest.mark.slow
def test_workers_and_the_api_serve_prometheus_metrics(env: dict[str, str]) -> None:
    port = free_port()
    env = {**env, "BATCHWORK_METRICS_PORT": str(port)}
    alice = make_key(env["BATCHWORK_DATABASE_URL"], "alice")
    with workers(env), api_server(env) as api:
        client = Tenant(api.url, alice)
        job = client.submit(POISON, ["a", "poison", "b"], priority="high")["id"]
        client.wait(job)
        client.http.get("/v1/jobs/not-a-job")

        lane = f'lane="high",model="{POISON}"'

        def worker_metrics() -> dict[str, float] | None:
            samples = scrape(f"http://127.0.0.1:{port}/metrics")
            return samples if samples.get(f'batchwork_items_total{{{lane},outcome="error"}}') else None

        samples = wait_until(worker_metrics, 60, lambda: "the worker's metrics never counted the items")
        assert samples[f'batchwork_items_total{{{lane},outcome="ok"}}'] == 2
        assert samples[f'batchwork_items_total{{{lane},outcome="error"}}'] == 1
        assert samples[f'batchwork_batches_total{{{lane},outcome="error"}}'] >= 1
        assert samples[f"batchwork_batch_size_items_count{{{lane}}}"] >= 1
        assert samples[f"batchwork_batch_run_seconds_count{{{lane}}}"] >= 1
        assert samples[f"batchwork_queue_wait_seconds_count{{{lane}}}"] >= 1
        assert samples['batchwork_items_held{lane="high"}'] == 0

        api_samples = scrape(f"{api.url}/metrics")
        route = 'method="GET",route="/v1/jobs/{job_id}"'
        assert api_samples[f'batchwork_api_requests_total{{{route},status="200"}}'] >= 1
        assert api_samples[f'batchwork_api_requests_total{{{route},status="404"}}'] == 1
        assert api_samples[f"batchwork_api_request_seconds_count{{{route}}}"] >= 2
        assert api_samples['batchwork_queue_depth_messages{lane="high"}'] == 0


def test_healthz_says_when_the_database_needs_migrating(redis_url: str, pg_url: str) -> None:
    server = ApiProcess(service_env(redis_url, pg_url, metrics_port=0))  # pg_url: a schema never migrated
    try:
        answer = wait_until(
            lambda: _health(server.url), 60, lambda: "the API never answered:\n" + "\n".join(server.log[-20:])
        )
    finally:
        server.stop()
    assert answer.status_code == 503
    body = answer.json()
    assert body["broker"] == "ok" and "run `batchwork migrate`" in body["database"]


def _health(url: str) -> httpx.Response | None:
    try:
        return httpx.get(f"{url}/healthz", timeout=2)
    except httpx.TransportError:
        return None


def test_a_broker_that_is_down_is_503_with_retry_after_and_no_password(pg_store: ResultStore) -> None:
    env = service_env("redis://:s3cret@127.0.0.1:1/0", pg_store.url, metrics_port=0)  # nothing listens on 1
    alice = make_key(pg_store.url, "alice")
    server = ApiProcess(env)
    try:
        health = wait_until(lambda: _health(server.url), 60, lambda: "\n".join(server.log[-20:]))
        assert health.status_code == 503
        client = Tenant(server.url, alice)
        for body in ({"json": {"model": "noop", "inputs": ["a"]}}, {"content": b'"a"\n'}):
            headers = {} if "json" in body else {"Content-Type": "application/x-ndjson"}
            answer = client.http.post("/v1/jobs", params={"model": "noop"}, headers=headers, **body)
            assert answer.status_code == 503, answer.text
            assert answer.headers["Retry-After"]
            assert answer.json()["detail"].startswith("cannot reach the broker at redis://:***@127.0.0.1:1/0")
        assert not [line for line in server.log if "Traceback" in line]
    finally:
        server.stop()


def test_a_database_that_is_down_is_503_with_retry_after_in_every_route(redis_url: str) -> None:
    server = ApiProcess(service_env(redis_url, "postgresql+psycopg://batchwork:s3cret@127.0.0.1:1/none"))
    try:
        wait_until(lambda: _health(server.url), 60, lambda: "\n".join(server.log[-20:]))
        http = httpx.Client(base_url=server.url, headers={"Authorization": "Bearer bw_any"}, timeout=30)
        answers = [
            http.get("/v1/jobs"),
            http.get(f"/v1/jobs/{uuid.uuid4()}"),
            http.post("/v1/jobs", json={"model": "noop", "inputs": ["a"]}),
            http.post(
                "/v1/jobs",
                params={"model": "noop"},
                content=b'"a"\n',
                headers={"Content-Type": "application/x-ndjson"},
            ),
            http.get("/v1/models"),
        ]
    finally:
        server.stop()
    for answer in answers:
        assert answer.status_code == 503, answer.text
        assert answer.headers["Retry-After"]
        assert answer.json()["detail"].startswith(
            "cannot reach the database postgresql+psycopg://batchwork:***@"
        )
    assert not [line for line in server.log if "Traceback" in line]
