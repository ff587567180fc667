"""The HTTP API through real HTTP: `batchwork api` and a real worker on Redis and PostgreSQL.

Submit (JSON and streamed NDJSON), poll, stream results, list with a cursor, cancel; tenants kept apart in
every route. Keys, limits and metrics: test_api_limits.py.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis

from tests.integration.api_server import (
    Tenant,
    api_server,
    make_key,
    ndjson_chunks,
    scrape,
    texts,
    wait_until,
)
from tests.integration.processes import produce, service_env, workers
from worker.store.results import ResultStore

ECHO = "tests.support.models:Echo"
POISON = "tests.support.models:Poison"
QUEUES = ("batchwork.high", "batchwork.normal", "batchwork.bulk")


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
        assert answer.json()["detail"] == "line 2, column 10: not valid JSON (unexpected end of data)"
        json_answer = client.http.post("/v1/jobs", json={"model": "no-such-model", "inputs": ["x"]})
        assert json_answer.status_code == 422
        assert "unknown model 'no-such-model'" in json_answer.json()["detail"]

        # Bodies of several MiB are checked a MiB at a time while the next MiB arrives: a bad line in the
        # middle or at the very end still refuses everything.
        big = [orjson.dumps(item) + b"\n" for item in texts("big", 60_000)]  # about 2.6 MiB
        for where in (30_000, 59_999):
            bad = big[:where] + [b'{"id": "bad", "text": 7}\n'] + big[where + 1 :]
            answer = client.http.post(
                "/v1/jobs",
                params={"model": ECHO},
                content=(b"".join(bad[i : i + 5000]) for i in range(0, 60_000, 5000)),
                headers={"Content-Type": "application/x-ndjson"},
            )
            assert answer.status_code == 422
            assert answer.json()["detail"].startswith(f"line {where + 1}: ")

        # A client that goes away mid-body (in its first MiB, or after several) leaves nothing behind.
        whole = b"".join(big)
        for cut in (10, 2_000_000):
            with socket.create_connection(("127.0.0.1", api.port)) as raw:
                raw.sendall(
                    f"POST /v1/jobs?model={ECHO} HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer {alice}\r\n"
                    f"Content-Type: application/x-ndjson\r\nContent-Length: {len(whole)}\r\n\r\n".encode()
                    + whole[:cut]
                )
                time.sleep(0.3)

        def broken_off() -> float:
            answered = scrape(f"{api.url}/metrics").items()
            return sum(
                value
                for name, value in answered
                if name.startswith("batchwork_api_requests_total{")
                and 'route="/v1/jobs"' in name
                and 'status="400"' in name
            )

        wait_until(lambda: broken_off() == 2, 60, lambda: f"{broken_off()} broken bodies answered 400")
        assert client.http.get("/v1/jobs").json()["jobs"] == []
        assert sum(broker.llen(queue) for queue in QUEUES) == 0
        assert not [line for line in api.log if "Traceback" in line or "ERROR" in line], api.log
        answer = client.http.post(
            "/v1/jobs",
            params={"model": ECHO},
            content=b"".join(big),
            headers={"Content-Type": "application/x-ndjson"},
        )
        assert answer.status_code == 202, answer.text
        assert answer.json()["counts"]["total"] == 60_000
    messages = [orjson.loads(message) for message in broker.lrange("batchwork.normal", 0, -1)]
    kwargs = [orjson.loads(base64.b64decode(message["body"]))[1] for message in messages]
    published = sorted((part["offset"], len(part["inputs"])) for part in kwargs)
    assert {part["total"] for part in kwargs} == {60_000}
    assert [offset for offset, _ in published] == [
        sum(size for _, size in published[:i]) for i in range(len(published))
    ]
    assert sum(size for _, size in published) == 60_000
    assert max(size for _, size in published) == 512  # BATCHWORK_SUBMIT_CHUNK_SIZE
    broker.delete(*QUEUES)


@pytest.mark.slow
def test_listing_pages_through_a_tenants_jobs_newest_first_with_a_cursor(env: dict[str, str]) -> None:
    alice = make_key(env["BATCHWORK_DATABASE_URL"], "alice")
    with api_server(env) as api:  # no worker: the jobs stay queued
        # Where it listens, in the line benches wait for (uvicorn is silent about a socket passed to it).
        announced = f"Uvicorn running on {api.url}"
        wait_until(lambda: any(announced in line for line in api.log), 10, lambda: "\n".join(api.log))
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
def test_an_admin_key_sees_a_job_infer_delay_queued_before_any_worker_took_it(env: dict[str, str]) -> None:
    """Such a job is only a Redis record so far: the API finds it as the Python client does (it was 404)."""
    url = env["BATCHWORK_DATABASE_URL"]
    alice, ops = make_key(url, "alice"), make_key(url, "ops", admin=True)
    [delayed] = produce(env, [{"via": "delay", "model": ECHO, "inputs": ["a", "b"]}])
    with api_server(env) as api:
        admin = Tenant(api.url, ops).http
        job = admin.get(f"/v1/jobs/{delayed}")
        assert job.status_code == 200, job.text
        assert job.json()["state"] == "queued" and job.json()["counts"]["total"] == 2
        assert admin.get(f"/v1/jobs/{delayed}/results").text == ""
        assert [job["id"] for job in admin.get("/v1/jobs").json()["jobs"]] == [delayed]
        assert Tenant(api.url, alice).http.get(f"/v1/jobs/{delayed}").status_code == 404
    redis.Redis.from_url(env["BATCHWORK_BROKER_URL"]).delete(*QUEUES)


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


def checking_processes(api_pid: int) -> list[int]:
    """The API's checking processes: its children that multiprocessing spawned (not its resource tracker)."""
    children = [
        int(pid)
        for task in Path(f"/proc/{api_pid}/task").iterdir()
        for pid in (task / "children").read_text().split()
    ]
    return [pid for pid in children if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]


@pytest.mark.slow
def test_a_checking_process_that_dies_costs_no_later_upload(env: dict[str, str]) -> None:
    env = {**env, "BATCHWORK_API_CHECK_PROCESSES": "2"}
    alice = make_key(env["BATCHWORK_DATABASE_URL"], "alice")
    body = b"".join(orjson.dumps(item) + b"\n" for item in texts("k", 40_000))  # about 1.7 MiB: 2 pieces
    with api_server(env) as api:
        client = Tenant(api.url, alice)
        checkers = checking_processes(api.proc.pid)
        assert len(checkers) == 2
        for pid in checkers:
            os.kill(pid, signal.SIGKILL)
        wait_until(lambda: not set(checkers) & set(checking_processes(api.proc.pid)), 60, lambda: "unkilled")

        answer = client.http.post(
            "/v1/jobs", params={"model": ECHO}, content=body, headers={"Content-Type": "application/x-ndjson"}
        )

        assert answer.status_code == 202, answer.text
        assert answer.json()["counts"]["total"] == 40_000
        assert len(checking_processes(api.proc.pid)) == 2
    redis.Redis.from_url(env["BATCHWORK_BROKER_URL"]).delete(*QUEUES)
