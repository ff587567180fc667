"""The HTTP API's overhead, side by side in one run on real Redis + PostgreSQL:

1. submit: items/s of one large NDJSON body POSTed to `batchwork api` (to its 202, every message in
   Redis) vs ``client.submit`` of the same items in this process (to its return). Runs alternate.
2. poll: latency of ``GET /v1/jobs/{id}`` under many concurrent pollers (p50, p99, requests/s).

No worker runs: both measure the front door, and the submitted jobs stay queued. Prints tables, never
asserts; cleans up its Redis database, PostgreSQL schema and the API process. From the repository root:
``python -m bench.api [--items 100000] [--repeats 3] [--pollers 50] [--polls 40]``.
"""

from __future__ import annotations

import argparse
import http.client
import os
import re
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import orjson

from bench import processes
from bench.processes import WorkerProcess, python_module
from bench.services import postgres_schema, redis_database

UVICORN_READY = re.compile(r"Uvicorn running on")
MODEL = "noop"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--items", type=int, default=100_000, help="items in the submitted job")
    parser.add_argument("--repeats", type=int, default=3, help="submits of each kind, alternating")
    parser.add_argument("--pollers", type=int, default=50, help="concurrent GET /v1/jobs/{id} loops")
    parser.add_argument("--polls", type=int, default=40, help="requests per poller")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--redis-url", help="an existing Redis (default: a redis-server of the bench's own)")
    parser.add_argument("--redis-db", type=int, default=13)
    parser.add_argument(
        "--postgres-url", help="an existing PostgreSQL (default: a server of the bench's own)"
    )
    return parser.parse_args(argv)


def items(count: int) -> list[dict[str, str]]:
    return [{"id": f"doc-{i}", "text": f"document number {i} about batch inference"} for i in range(count)]


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    with (
        redis_database(args.redis_url, args.redis_db, "bench-api") as (broker, broker_url),
        postgres_schema(args.postgres_url, "bench") as (_admin, _schema, database_url),
    ):
        _point_settings_at(broker_url, database_url)
        from worker.store.schema import migrate

        migrate(database_url)
        env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHWORK_")}
        # Room for every submit of the run; the bench measures speed, not the limits.
        env.update(BATCHWORK_BROKER_URL=broker_url, BATCHWORK_DATABASE_URL=database_url, PYTHONUNBUFFERED="1")
        env.update(BATCHWORK_API_MAX_TENANT_ITEMS=str(args.items * (args.repeats + 1)))
        env.update(BATCHWORK_API_MAX_QUEUE_DEPTH=str(10**6))
        api = WorkerProcess(
            python_module("worker.cli", "api", "--port", str(args.port)), env, "api", UVICORN_READY
        )
        try:
            api.wait_ready()
            key = _key(database_url)
            job_id = submit_section(args, f"http://127.0.0.1:{args.port}", key, api)
            poll_section(args, args.port, key, job_id)
            _print_problems(api)
        finally:
            processes.stop_all()
            broker.flushdb()
            sys.modules["worker.store.results"].ResultStore.for_url(database_url).close()


def _point_settings_at(broker_url: str, database_url: str) -> None:
    """This process's settings (read once, at the first worker import) name the bench's services."""
    if "worker.settings" in sys.modules:
        raise RuntimeError("worker modules were imported before the bench set BATCHWORK_*")
    for name in [k for k in os.environ if k.startswith("BATCHWORK_")]:
        del os.environ[name]
    os.environ.update(BATCHWORK_BROKER_URL=broker_url, BATCHWORK_DATABASE_URL=database_url)


def _key(database_url: str) -> str:
    from worker.store.keys import KeyStore
    from worker.store.results import ResultStore

    return KeyStore(ResultStore.for_url(database_url).engine).create("bench")[1]


def submit_section(args: argparse.Namespace, url: str, key: str, api: WorkerProcess) -> str:
    from worker.client import Client

    inputs = items(args.items)
    body = b"".join(orjson.dumps(item) + b"\n" for item in inputs)
    client = Client()
    http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=600)
    client_path, api_path = "client.submit", "POST /v1/jobs (NDJSON)"
    seconds: dict[str, list[float]] = {client_path: [], api_path: []}
    # CPU seconds of the path's own processes: this one for client.submit; the API and its checking
    # processes for the POST (Redis and PostgreSQL are left out of both). On a loaded machine they move
    # less than wall time.
    cpu: dict[str, list[float]] = {client_path: [], api_path: []}
    job_id = ""
    for _ in range(args.repeats):
        started, cpu_before = time.perf_counter(), time.process_time()
        client.submit(MODEL, inputs)
        seconds[client_path].append(time.perf_counter() - started)
        cpu[client_path].append(time.process_time() - cpu_before)
        started, cpu_before = time.perf_counter(), processes.group_cpu_s(api.pid)
        answer = http.post(
            "/v1/jobs",
            params={"model": MODEL},
            content=body,
            headers={"Content-Type": "application/x-ndjson"},
        )
        seconds[api_path].append(time.perf_counter() - started)
        cpu[api_path].append(processes.group_cpu_s(api.pid) - cpu_before)
        if answer.status_code != 202:
            raise RuntimeError(f"the API refused the submit: {answer.status_code} {answer.text}")
        job_id = answer.json()["id"]
    print(f"\n1. submit of {args.items:,} {MODEL} items ({len(body) / 2**20:.1f} MiB of NDJSON), no worker")
    rates = {name: args.items / statistics.median(values) for name, values in seconds.items()}
    rows = [
        (
            name,
            " ".join(f"{value:.2f}" for value in values),
            f"{rates[name]:,.0f}",
            " ".join(f"{value:.2f}" for value in cpu[name]),
        )
        for name, values in seconds.items()
    ]
    print_table(("path", "seconds per run", "items/s (median)", "CPU s per run"), rows)
    api_rate, client_rate = rates[api_path], rates[client_path]
    print(f"API / client.submit: {api_rate / client_rate:.2f}x (target >= 1.0x)")
    print(f"load average: {os.getloadavg()[0]:.2f} (1 min), {os.cpu_count()} CPUs")
    return job_id


def poll_section(args: argparse.Namespace, port: int, key: str, job_id: str) -> None:
    latencies, wall = _poll(port, key, job_id, args.pollers, args.polls)
    latencies.sort()
    print(f"\n2. GET /v1/jobs/{{id}} under {args.pollers} concurrent pollers, {args.polls} requests each")
    rows = [
        (
            len(latencies),
            f"{_percentile(latencies, 50) * 1000:.1f}",
            f"{_percentile(latencies, 99) * 1000:.1f}",
            f"{latencies[-1] * 1000:.1f}",
            f"{len(latencies) / wall:,.0f}",
        )
    ]
    print_table(("requests", "p50 ms", "p99 ms", "max ms", "requests/s"), rows)


def _poll(port: int, key: str, job_id: str, pollers: int, polls: int) -> tuple[list[float], float]:
    """Each poller a thread with one keep-alive connection. The stdlib client, not httpx: httpx's async
    pool spent more CPU per request than the API itself here, so the bench measured its own client."""
    headers = {"Authorization": f"Bearer {key}"}
    path = f"/v1/jobs/{job_id}"
    start = threading.Barrier(pollers + 1)

    def poller() -> list[float]:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        connection.request("GET", path, headers=headers)  # warm: connect, and the API's key cache
        connection.getresponse().read()
        start.wait()
        spent = []
        for _ in range(polls):
            began = time.perf_counter()
            connection.request("GET", path, headers=headers)
            answer = connection.getresponse()
            body = answer.read()
            spent.append(time.perf_counter() - began)
            if answer.status != 200:
                raise RuntimeError(f"poll answered {answer.status}: {body[:200]!r}")
        connection.close()
        return spent

    with ThreadPoolExecutor(pollers) as pool:
        futures = [pool.submit(poller) for _ in range(pollers)]
        start.wait()
        began = time.perf_counter()
        results = [future.result() for future in futures]
        wall = time.perf_counter() - began
    return [latency for result in results for latency in result], wall


def _percentile(ordered: list[float], percent: float) -> float:
    return ordered[min(len(ordered) - 1, round(percent / 100 * (len(ordered) - 1)))]


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    cells = [[str(value) for value in row] for row in rows]
    widths = [max(len(str(header)), *(len(row[i]) for row in cells)) for i, header in enumerate(headers)]
    print("  ".join(str(header).ljust(width) for header, width in zip(headers, widths, strict=True)))
    for row in cells:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))


def _print_problems(api: WorkerProcess) -> None:
    problems = [line for line in api.log if "ERROR" in line or "Traceback" in line]
    if problems:
        print("\nAPI log problems:\n" + "\n".join(problems[:20]))


if __name__ == "__main__":
    main()
