"""README promises that had no test of their own, each through the surface a user has: the Python client
(``worker.client``), the ``batchwork`` command, a worker's settings and metrics, the jobs page's cookie."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import redis

from tests.integration.api_server import api_server, free_port, make_key, scrape
from tests.integration.processes import (
    WorkerProcess,
    produce,
    service_env,
    wait_finished,
    wait_until,
    workers,
)
from worker.broker.keys import Keys
from worker.store.results import ResultStore
from worker.store.values import FINISHED_STATES

ECHO = "tests.support.models:Echo"
OOM16 = "tests.support.models:OutOfMemoryAbove16"


def echoed(text: str) -> dict[str, Any]:
    return {"echo": text, "n": len(text)}


@pytest.mark.slow
def test_the_python_client_waits_reads_results_and_cancels(producer: dict[str, str]) -> None:
    from worker import client
    from worker.errors import JobNotFound
    from worker.tasks import infer

    job = infer.delay(model=ECHO, inputs=["first text", {"id": "d2", "text": "second"}], priority="normal")
    queued = client.status(job.id)  # no worker yet: read from the job's record in Redis
    assert (queued.state, queued.total, queued.done, queued.model) == ("queued", 2, 0, ECHO)
    with pytest.raises(TimeoutError, match="still queued"):
        client.wait(job.id, timeout_s=0.5)
    doomed = client.submit(ECHO, ["never run", "nor this"])
    assert client.cancel(doomed) is True
    assert client.status(doomed).state == "cancelled"
    with pytest.raises(JobNotFound):
        client.status(str(uuid.uuid4()))

    with workers({**producer, "BATCHWORK_METRICS_PORT": "0"}):
        finished = client.wait(job.id, timeout_s=120)
        big = client.submit(ECHO, [f"text {i}" for i in range(40)], priority="bulk")
        assert client.wait(big, timeout_s=120).state == "succeeded"
        client.wait(doomed, timeout_s=60)
    assert (finished.state, finished.total, finished.done, finished.failed) == ("succeeded", 2, 2, 0)
    assert finished.started_at is not None and finished.finished_at is not None
    assert list(client.results(job.id)) == [
        (0, echoed("first text"), None, None),
        (1, echoed("second"), None, "d2"),
    ]
    assert [(r.index, r.output) for r in client.results(big)] == [(i, echoed(f"text {i}")) for i in range(40)]
    assert client.cancel(job.id) is False  # finished: nothing to cancel
    assert client.status(job.id).state == "succeeded"
    assert client.status(doomed).state == "cancelled"  # a worker that took its messages kept it so


@pytest.mark.slow
def test_a_job_cancelled_before_any_worker_took_it_keeps_no_outputs(producer: dict[str, str]) -> None:
    from worker import client

    doomed = client.submit(ECHO, ["never run", "nor this"])
    assert client.cancel(doomed) is True
    with workers({**producer, "BATCHWORK_METRICS_PORT": "0"}):
        wait_until(lambda: len(list(client.results(doomed))) == 2, 60, lambda: "the items were never stored")
    assert client.status(doomed).state == "cancelled"
    assert [(r.output, r.error) for r in client.results(doomed)] == [(None, "cancelled")] * 2


@pytest.mark.slow
def test_batchwork_submit_then_results_to_a_file(
    redis_url: str, pg_url: str, pg_store: ResultStore, tmp_path: Path
) -> None:
    env = service_env(redis_url, pg_url, metrics_port=0)
    rows = [{"id": f"doc-{i}", "text": f"document number {i}"} for i in range(25)]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    cli = [sys.executable, "-m", "worker.cli"]
    submitted = subprocess.run(
        [*cli, "submit", str(source), "-m", ECHO], env=env, cwd=tmp_path, capture_output=True, text=True
    )
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    assert str(uuid.UUID(job_id)) == job_id  # the job id, alone on its line
    assert pg_store.status(job_id).total == 25
    with workers(env):
        [status] = wait_finished(pg_store, [job_id])
    assert status.state == "succeeded"

    out = tmp_path / "out.jsonl"
    written = subprocess.run(
        [*cli, "results", job_id, "-o", str(out)], env=env, cwd=tmp_path, capture_output=True, text=True
    )
    assert written.returncode == 0, written.stderr
    expected = [{"index": i, "id": row["id"], "output": echoed(row["text"])} for i, row in enumerate(rows)]
    assert [orjson.loads(line) for line in out.read_bytes().splitlines()] == expected
    printed = subprocess.run([*cli, "results", job_id], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert printed.returncode == 0, printed.stderr
    assert [orjson.loads(line) for line in printed.stdout.splitlines()] == expected


def listening_ports(pid: int) -> set[int]:
    """TCP ports process ``pid`` listens on (its socket inodes matched against /proc/net/tcp*)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = fd.readlink().as_posix()
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


@pytest.mark.slow
def test_queue_prefix_task_events_off_and_metrics_port_zero(
    redis_url: str, pg_url: str, pg_store: ResultStore
) -> None:
    """Two deployments on one Redis database: the default one (task events on, metrics on a port) and one
    with BATCHWORK_QUEUE=other, BATCHWORK_TASK_EVENTS=false and BATCHWORK_METRICS_PORT=0."""
    port = free_port()
    default_env = service_env(redis_url, pg_url, metrics_port=port)
    other_env = service_env(redis_url, pg_url, queue="other", task_events="false", metrics_port=0)
    broker = redis.Redis.from_url(redis_url)
    [default_job] = produce(default_env, [{"via": "delay", "model": ECHO, "inputs": ["to the default"]}])
    [other_job] = produce(other_env, [{"via": "submit", "model": ECHO, "inputs": ["to other"] * 3}])
    assert broker.llen("batchwork.normal") == 1 and broker.llen("other.normal") == 1

    events = broker.pubsub()
    events.psubscribe("*celeryev*")  # Celery's event exchange (a fanout: Redis PUBLISH)
    default_worker = WorkerProcess(default_env, "default@test")
    other_worker = WorkerProcess(other_env, "other@test")
    try:
        default_worker.wait_ready()
        other_worker.wait_ready()
        statuses = wait_finished(pg_store, [default_job, other_job])
        assert [s.state for s in statuses] == ["succeeded", "succeeded"]
        assert port in wait_until(
            lambda: listening_ports(default_worker.proc.pid) or None, 30, lambda: "no metrics port"
        )
        assert listening_ports(other_worker.proc.pid) == set()
        # Each deployment's worker took its own deployment's job, and only that.
        assert {b.worker for b in pg_store.recent_batches(default_job)} == {"default@test"}
        assert {b.worker for b in pg_store.recent_batches(other_job)} == {"other@test"}

        task_events: dict[str, set[str]] = {"default@test": set(), "other@test": set()}
        heartbeats: set[str] = set()

        def default_task_events_seen() -> bool:
            while (message := events.get_message(timeout=0.05)) is not None:
                if message["type"] != "pmessage":
                    continue
                body = json.loads(_decoded(orjson.loads(message["data"])))
                for event in body if isinstance(body, list) else [body]:  # task events come in groups
                    if event["type"].startswith("task-"):
                        task_events[event["hostname"]].add(event["type"])
                    elif event["type"] == "worker-heartbeat":
                        heartbeats.add(event["hostname"])
            return {"task-received", "task-started", "task-succeeded"} <= task_events["default@test"]

        wait_until(default_task_events_seen, 30, lambda: f"task events: {task_events}")
        wait_until(
            lambda: default_task_events_seen() or "other@test" in heartbeats,
            30,
            lambda: f"no heartbeat from other@test: {heartbeats}",
        )
        assert task_events["other@test"] == set()  # its worker sends no task events, only its own
    finally:
        default_worker.stop()
        other_worker.stop()
        events.close()
        broker.close()
    assert not [line for line in other_worker.log if "metrics on" in line]


def _decoded(envelope: dict[str, Any]) -> str:
    import base64

    body = envelope["body"]
    if envelope.get("properties", {}).get("body_encoding") == "base64":
        return base64.b64decode(body).decode()
    return str(body)


@pytest.mark.slow
def test_worker_metrics_padding_oom_splits_and_redeliveries(
    redis_url: str, pg_url: str, pg_store: ResultStore
) -> None:
    port = free_port()
    env = service_env(
        redis_url,
        pg_url,
        metrics_port=0,
        visibility_timeout_s="4",
        simulated_base_ms="1500",
        simulated_per_item_ms="0",
        submit_chunk_size="5",
        batching={"simulated": {"max_batch_size": 5, "max_wait_ms": 10}},
    )
    broker = redis.Redis.from_url(redis_url)
    keys = Keys("batchwork")
    # A worker holding messages of a slow job dies; another receives them again.
    [slow_job] = produce(env, [{"via": "submit", "model": "simulated", "inputs": ["s"] * 20}])
    victim = WorkerProcess(env, "victim@test")
    try:
        victim.wait_ready()
        wait_until(lambda: broker.hlen(keys.unacked), 60, lambda: "the victim never held a message")
    finally:
        victim.proc.kill()
        victim.proc.wait()
    held = broker.hlen(keys.unacked)
    assert held >= 1

    texts = [" ".join(["word"] * n) for n in (1, 9, 2, 7, 3, 12, 4, 5, 11, 6, 8, 10)]
    with workers({**env, "BATCHWORK_METRICS_PORT": str(port)}):
        jobs = produce(
            {**env, "BATCHWORK_SUBMIT_CHUNK_SIZE": "1000"},  # the 40 items in one message, one batch
            [
                {"via": "submit", "model": "minilm", "inputs": texts},
                {"via": "submit", "model": OOM16, "inputs": [f"x{i}" for i in range(40)]},
            ],
        )
        statuses = wait_finished(pg_store, [*jobs, slow_job], timeout_s=180)
        assert [s.state for s in statuses] == ["succeeded"] * 3
        samples = wait_until(
            lambda: (
                (s := scrape(f"http://127.0.0.1:{port}/metrics")).get(
                    f'batchwork_items_total{{lane="normal",model="{OOM16}",outcome="ok"}}'
                )
                and s
            ),
            30,
            lambda: "the items were never counted",
        )
    broker.close()

    assert samples["batchwork_redelivered_deliveries_total"] == held
    assert samples[f'batchwork_oom_splits_total{{model="{OOM16}"}}'] >= 1
    minilm = [b for b in pg_store.recent_batches(jobs[0], limit=100) if b.padded_tokens > 0]
    fractions = [1 - b.real_tokens / b.padded_tokens for b in minilm]
    lane = 'lane="normal",model="minilm"'
    assert samples[f"batchwork_batch_padded_token_fraction_count{{{lane}}}"] == len(minilm) >= 1
    assert math.isclose(samples[f"batchwork_batch_padded_token_fraction_sum{{{lane}}}"], sum(fractions))
    assert sum(fractions) > 0  # texts of 1 to 12 words: some batch was padded


@pytest.mark.slow
def test_step_model_metrics_running_sequences_and_preemptions(
    redis_url: str, pg_url: str, pg_store: ResultStore, tiny_gpt2: Path
) -> None:
    port = free_port()
    env = service_env(
        redis_url,
        pg_url,
        metrics_port=port,
        model_options={"gpt2": {"path": str(tiny_gpt2), "kv_budget_tokens": 160}},
        preload=["gpt2"],
    )
    url = f"http://127.0.0.1:{port}/metrics"
    items = [{"prompt": f"request {i}", "max_new_tokens": 60} for i in range(48)]
    gauge = 'batchwork_running_sequences{model="gpt2"}'
    seen: list[float] = []
    with workers(env) as [worker]:
        # Scraped from before the job is published: a fast model may finish it before `produce` returns.
        with ThreadPoolExecutor(1) as pool:
            produced = pool.submit(produce, env, [{"via": "submit", "model": "gpt2", "inputs": items}])
            deadline = time.monotonic() + 120
            while not (produced.done() and _finished(pg_store, produced.result()[0])):
                assert time.monotonic() < deadline, "the job did not finish:\n" + "\n".join(worker.log[-40:])
                if value := scrape(url).get(gauge):
                    seen.append(value)
                time.sleep(0.01)
        [job_id] = produced.result()
        assert seen, "no running sequence was ever reported:\n" + "\n".join(worker.log[-40:])
        running = max(seen)
        [status] = wait_finished(pg_store, [job_id])
        after = scrape(url)
    assert status.state == "succeeded"
    assert 1 <= running <= len(items)
    assert after['batchwork_running_sequences{model="gpt2"}'] == 0
    assert (
        after['batchwork_preemptions_total{model="gpt2"}'] >= 1
    )  # 160 KV tokens hold two such sequences grown


@pytest.mark.slow
def test_int8_precision_is_a_worker_option(redis_url: str, pg_url: str, pg_store: ResultStore) -> None:
    import numpy as np

    texts = [
        "The quick brown fox jumps over the lazy dog.",
        "Batch inference stores every result in SQL.",
        "A completely different sentence about the weather today.",
        "short",
    ]
    outputs = {}
    for precision in ("fp32", "int8"):
        env = service_env(
            redis_url, pg_url, metrics_port=0, model_options={"minilm": {"precision": precision}}
        )
        with workers(env):
            [job_id] = produce(env, [{"via": "submit", "model": "minilm", "inputs": texts}])
            [status] = wait_finished(pg_store, [job_id])
        assert status.state == "succeeded"
        outputs[precision] = np.array([r.output for r in pg_store.results(job_id)], dtype=np.float64)
    fp32, int8 = outputs["fp32"], outputs["int8"]
    cosines = (fp32 * int8).sum(1) / (np.linalg.norm(fp32, axis=1) * np.linalg.norm(int8, axis=1))
    assert np.abs(fp32 - int8).max() > 1e-3  # the option took effect: quantized weights give other numbers
    assert cosines.min() > 0.8, cosines  # still the same embeddings, near enough (README: 0.839 at worst)


def test_the_jobs_page_cookie_is_httponly_and_kept_to_ui(
    redis_url: str, pg_url: str, pg_store: ResultStore
) -> None:
    env = service_env(redis_url, pg_url, metrics_port=0)
    key = make_key(pg_url, "alice")
    with api_server(env) as api:
        refused = httpx.post(f"{api.url}/ui/login", data={"key": "bw_not-a-key"})
        assert refused.status_code == 401 and "set-cookie" not in refused.headers
        answer = httpx.post(f"{api.url}/ui/login", data={"key": key})
        assert answer.status_code == 303
        [cookie] = answer.headers.get_list("set-cookie")
        name_value, *attributes = [part.strip() for part in cookie.split(";")]
        flags = {a.split("=", 1)[0].lower(): (a.split("=", 1) + [""])[1] for a in attributes}
        assert name_value.split("=", 1)[1] == key
        assert flags["path"] == "/ui"
        assert "httponly" in flags
        assert flags["samesite"].lower() == "strict"
        name = name_value.split("=", 1)[0]
        assert httpx.get(f"{api.url}/ui/", cookies={name: key}).status_code == 200
        # The cookie is for the page only: the API takes a Bearer key, never the cookie.
        assert httpx.get(f"{api.url}/v1/jobs", cookies={name: key}).status_code == 401


def _finished(store: ResultStore, job_id: str) -> bool:
    status = store.status(job_id)
    return status is not None and status.state in FINISHED_STATES
