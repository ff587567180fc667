"""The HTTP API through real HTTP: `batchwork api` and a real worker on Redis and PostgreSQL.

Submit (JSON and streamed NDJSON), poll, stream results, list with a cursor, cancel; tenants kept apart in
every route; 401, 413, 429 and 503 each provoked for real.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
import redis
from sqlalchemy import text

from api.auth import KEY_CACHE_S
from tests.integration.api_server import api_server, free_port, make_key, wait_until
from tests.integration.processes import produce, service_env, workers
from worker.store.db import make_engine
from worker.store.results import ResultStore
from worker.store.values import FINISHED_STATES

ECHO = "tests.support.models:Echo"
POISON = "tests.support.models:Poison"
QUEUES = ("batchwork.high", "batchwork.normal", "batchwork.bulk")


class Tenant:
    """An HTTP client holding one API key."""

    def __init__(self, url: str, key: str) -> None:
        self.http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=30)

    def submit(self, model: str, inputs: list[Any], **fields: Any) -> dict[str, Any]:
        answer = self.http.post("/v1/jobs", json={"model": model, "inputs": inputs, **fields})
        assert answer.status_code == 202, answer.text
        return answer.json()  # type: ignore[no-any-return]

    def wait(self, job_id: str, timeout_s: float = 60) -> dict[str, Any]:
        def finished() -> dict[str, Any] | None:
            job = self.http.get(f"/v1/jobs/{job_id}").json()
            return job if job["state"] in FINISHED_STATES else None

        return wait_until(finished, timeout_s, lambda: f"job {job_id} unfinished", poll_s=0.2)

    def results(self, job_id: str, **params: Any) -> list[dict[str, Any]]:
        answer = self.http.get(f"/v1/jobs/{job_id}/results", params=params)
        assert answer.status_code == 200, answer.text
        assert answer.headers["content-type"].startswith("application/x-ndjson")
        return [orjson.loads(line) for line in answer.content.splitlines()]


def texts(prefix: str, n: int) -> list[dict[str, str]]:
    return [{"id": f"{prefix}-{i}", "text": f"{prefix} item {i}"} for i in range(n)]


def ndjson_chunks(items: list[Any], per_chunk: int = 100) -> Iterator[bytes]:
    """The body in pieces, so httpx sends it chunked (no Content-Length) as a streaming producer would."""
    for start in range(0, len(items), per_chunk):
        yield b"".join(orjson.dumps(item) + b"\n" for item in items[start : start + per_chunk])


@pytest.fixture
def env(redis_url: str, pg_url: str, pg_store: ResultStore) -> dict[str, str]:
    return service_env(redis_url, pg_url, metrics_port=0)


@pytest.mark.slow
def test_json_and_ndjson_jobs_run_and_their_results_stream_in_index_order(env: dict[str, str]) -> None:
    alice = make_key(env["BATCHWORK_DATABASE_URL"], "alice")
    with workers(env), api_server(env) as api:
        client = Tenant(api.url, alice)
        posted = client.submit(ECHO, texts("j", 30), metadata={"batch": "nightly"})
        assert posted["state"] in {"queued", "running", "succeeded"}
        assert posted["counts"]["total"] == 30
        items = texts("n", 1500)
        answer = client.http.post(
            "/v1/jobs",
            params={"model": ECHO, "priority": "bulk"},
            content=ndjson_chunks(items),
            headers={"Content-Type": "application/x-ndjson"},
        )
        assert answer.status_code == 202, answer.text
        streamed = answer.json()

        job = client.wait(posted["id"])
        assert job["state"] == "succeeded"
        assert job["counts"] == {"total": 30, "done": 30, "failed": 0, "errors": {}}
        assert job["metadata"] == {"batch": "nightly"}
        assert job["started_at"] and job["finished_at"]
        lines = client.results(posted["id"])
        assert [line["index"] for line in lines] == list(range(30))
        assert lines[3] == {"index": 3, "id": "j-3", "output": {"echo": "j item 3", "n": 8}}
        assert [line["index"] for line in client.results(posted["id"], after=4, limit=3)] == [5, 6, 7]

        assert client.wait(streamed["id"])["state"] == "succeeded"
        lines = client.results(streamed["id"])
        assert len(lines) == 1500
        assert [line["id"] for line in lines] == [item["id"] for item in items]
        assert streamed["priority"] == "bulk"


@pytest.mark.slow
def test_a_bad_ndjson_line_refuses_the_whole_body_and_enqueues_nothing(env: dict[str, str]) -> None:
    alice = make_key(env["BATCHWORK_DATABASE_URL"], "alice")
    broker = redis.Redis.from_url(env["BATCHWORK_BROKER_URL"])
    with api_server(env) as api:
        client = Tenant(api.url, alice)
        body = [orjson.dumps(item) for item in texts("b", 1200)]
        body.insert(1100, b'{"id": "bad", "text": ""}')
        answer = client.http.post(
            "/v1/jobs",
            params={"model": ECHO},
            content=b"\n".join(body),
            headers={"Content-Type": "application/x-ndjson"},
        )
        assert answer.status_code == 422
        assert answer.json()["detail"] == "line 1101: field 'text' is empty"
        answer = client.http.post(
            "/v1/jobs",
            params={"model": ECHO},
            content=b'{"text": "fine"}\n{"text": \n',
            headers={"Content-Type": "application/x-ndjson"},
        )
        assert answer.status_code == 422
        assert answer.json()["detail"].startswith("line 2: not valid JSON")
        json_answer = client.http.post("/v1/jobs", json={"model": "no-such-model", "inputs": ["x"]})
        assert json_answer.status_code == 422
        assert "unknown model 'no-such-model'" in json_answer.json()["detail"]

        assert client.http.get("/v1/jobs").json()["jobs"] == []
    assert sum(broker.llen(queue) for queue in QUEUES) == 0


@pytest.mark.slow
def test_listing_pages_through_a_tenants_jobs_newest_first_with_a_cursor(env: dict[str, str]) -> None:
    alice = make_key(env["BATCHWORK_DATABASE_URL"], "alice")
    with api_server(env) as api:  # no worker: the jobs stay queued
        client = Tenant(api.url, alice)
        ids = [client.submit(ECHO, [f"job {n}"])["id"] for n in range(5)]
        pages: list[list[str]] = []
        cursor = None
        while True:
            params = {"limit": 2, **({"cursor": cursor} if cursor else {})}
            page = client.http.get("/v1/jobs", params=params).json()
            pages.append([job["id"] for job in page["jobs"]])
            cursor = page["next_cursor"]
            if cursor is None:
                break
        assert [len(page) for page in pages] == [2, 2, 1]
        assert [job_id for page in pages for job_id in page] == ids[::-1]
        client.http.post(f"/v1/jobs/{ids[0]}/cancel")
        cancelled = client.http.get("/v1/jobs", params={"state": "cancelled"}).json()["jobs"]
        assert [job["id"] for job in cancelled] == [ids[0]]
        assert client.http.get("/v1/jobs", params={"cursor": "nonsense"}).status_code == 422


@pytest.mark.slow
def test_another_tenants_job_is_404_in_every_route_and_admins_see_the_default_tenant(
    env: dict[str, str],
) -> None:
    url = env["BATCHWORK_DATABASE_URL"]
    alice, bob, ops = make_key(url, "alice"), make_key(url, "bob"), make_key(url, "ops", admin=True)
    [from_python] = produce(env, [{"via": "submit", "model": ECHO, "inputs": ["from python"]}])
    with api_server(env) as api:
        mine = Tenant(api.url, alice).submit(ECHO, ["alice's"])["id"]
        other = Tenant(api.url, bob).http
        for job_id in (mine, from_python):
            assert other.get(f"/v1/jobs/{job_id}").status_code == 404
            assert other.get(f"/v1/jobs/{job_id}/results").status_code == 404
            assert other.post(f"/v1/jobs/{job_id}/cancel").status_code == 404
        assert other.get("/v1/jobs").json()["jobs"] == []
        assert Tenant(api.url, alice).http.get(f"/v1/jobs/{mine}").json()["state"] == "queued"

        admin = Tenant(api.url, ops).http
        assert admin.get(f"/v1/jobs/{from_python}").status_code == 200
        assert admin.get(f"/v1/jobs/{mine}").status_code == 404
        assert [job["id"] for job in admin.get("/v1/jobs").json()["jobs"]] == [from_python]


@pytest.mark.slow
def test_cancel_and_error_kinds(env: dict[str, str]) -> None:
    env = {**env, "BATCHWORK_SIMULATED_BASE_MS": "100", "BATCHWORK_SIMULATED_PER_ITEM_MS": "0"}
    env["BATCHWORK_BATCHING"] = json.dumps({"simulated": {"max_batch_size": 5, "max_wait_ms": 5}})
    alice = make_key(env["BATCHWORK_DATABASE_URL"], "alice")
    with workers(env), api_server(env) as api:
        client = Tenant(api.url, alice)
        slow = client.submit("simulated", [f"s{i}" for i in range(300)])["id"]
        wait_until(
            lambda: client.http.get(f"/v1/jobs/{slow}").json()["counts"]["done"] > 0,
            30,
            lambda: "the slow job never started",
        )
        cancelled = client.http.post(f"/v1/jobs/{slow}/cancel").json()
        assert cancelled["state"] == "cancelled"
        poisoned = client.submit(POISON, ["fine", "poison", "fine too"])["id"]

        def every_item_ended() -> dict[str, Any] | None:
            job = client.http.get(f"/v1/jobs/{slow}").json()
            return job if job["counts"]["done"] + job["counts"]["failed"] == 300 else None

        job = wait_until(every_item_ended, 60, lambda: "the cancelled job's items did not all end")
        assert job["counts"]["errors"] == {"cancelled": job["counts"]["failed"]}
        assert job["counts"]["failed"] > 0
        poison = client.wait(poisoned)
        assert poison["state"] == "partial"
        assert poison["counts"]["errors"] == {"ValueError": 1}
        assert client.results(poisoned)[1] == {
            "index": 1,
            "id": None,
            "error": "ValueError: cannot digest 'poison'",
        }


@pytest.mark.slow
def test_missing_wrong_and_revoked_keys_are_401(env: dict[str, str]) -> None:
    url = env["BATCHWORK_DATABASE_URL"]
    alice = make_key(url, "alice")
    with api_server(env) as api:
        bare = httpx.Client(base_url=api.url)
        for route in ("/v1/jobs", "/v1/models", "/v1/jobs/x", "/v1/jobs/x/results"):
            assert bare.get(route).status_code == 401
        assert bare.post("/v1/jobs", json={"model": ECHO, "inputs": ["x"]}).status_code == 401
        assert Tenant(api.url, "bw_not-a-key").http.get("/v1/jobs").status_code == 401
        assert bare.get("/v1/jobs", headers={"Authorization": f"Basic {alice}"}).status_code == 401
        answer = Tenant(api.url, alice).http.get("/v1/models")
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
        # The API remembers a key it found for KEY_CACHE_S: a revoked one is refused within that long.
        revoked_client = Tenant(api.url, alice).http

        def refused() -> httpx.Response | None:
            answer = revoked_client.get("/v1/jobs")
            return answer if answer.status_code == 401 else None

        answer = wait_until(refused, KEY_CACHE_S + 5, lambda: "the revoked key still works")
        assert answer.headers["www-authenticate"] == "Bearer"
        assert "\n" not in answer.json()["detail"]
        assert bare.get("/healthz").json() == {"status": "ok", "broker": "ok", "database": "ok"}


def test_keys_create_prints_a_key_once_and_stores_only_its_hash(sqlite_url: str) -> None:
    env = service_env("redis://127.0.0.1:6379/0", sqlite_url)
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

        samples = wait_until(worker_metrics, 10, lambda: "the worker's metrics never counted the items")
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


def scrape(url: str) -> dict[str, float]:
    """Prometheus text format as {'name{labels}': value}, labels in the exposition's own order."""
    samples = {}
    for line in httpx.get(url, timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples
