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
import os
import statistics
import time
from collections.abc import Sequence

import httpx
import orjson

from bench import harness as h
from tests.support.services import free_port

MODEL = "noop"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = h.arguments(__doc__)
    p.add_argument("--items", type=int, default=100_000, help="items in the submitted job")
    p.add_argument("--repeats", type=int, default=3, help="submits of each kind, alternating")
    p.add_argument("--pollers", type=int, default=50, help="concurrent GET /v1/jobs/{id} loops")
    p.add_argument("--polls", type=int, default=None, help="requests per poller (40; 300 with --auth)")
    p.add_argument(
        "--port",
        type=int,
        default=8765,
        help="--auth: lookup on PORT, no lookup on PORT+1 (the submit bench takes a free port)",
    )
    p.add_argument("--auth", default="", metavar="POLLERS", help="instead: the key lookup's cost (e.g. 1,16)")
    p.add_argument("--rounds", type=int, default=3, help="--auth: rounds, alternating")
    p.add_argument("--serve", choices=("lookup", "no-lookup"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.polls = args.polls or (300 if args.auth else 40)
    return args


def items(count: int) -> list[dict[str, str]]:
    return [{"id": f"doc-{i}", "text": f"document number {i} about batch inference"} for i in range(count)]


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.serve:
        serve(args.serve, args.port)
        return
    h.header("bench.api", args)
    with h.stack() as found:
        from worker.client import Client
        from worker.store.api_keys import KeyStore

        key = KeyStore(Client().store.engine).create("bench")[1]
        if args.auth:
            auth_section(args, found, key)
            return
        # Room for every submit of the run; the bench measures speed, not the limits.
        limits = {
            "api_max_tenant_items": str(args.items * (args.repeats + 1)),
            "api_max_queue_depth": "1000000",
        }
        args.port = free_port()  # two benches at once (or one just ended) must not meet on one port
        api = h.api(found, args.port, **limits)
        api.wait_ready()
        job_id = submit_section(args, f"http://127.0.0.1:{args.port}", key, api)
        poll_section(args, args.port, key, job_id)
        h.print_problems([api])


def submit_section(args: argparse.Namespace, url: str, key: str, api: h.Proc) -> str:
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
        started, cpu_before = time.perf_counter(), h.group_cpu_s(api.pid)
        answer = http.post(
            "/v1/jobs",
            params={"model": MODEL},
            content=body,
            headers={"Content-Type": "application/x-ndjson"},
        )
        seconds[api_path].append(time.perf_counter() - started)
        cpu[api_path].append(h.group_cpu_s(api.pid) - cpu_before)
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
    h.print_table(("path", "seconds per run", "items/s (median)", "CPU s per run"), rows)
    api_rate, client_rate = rates[api_path], rates[client_path]
    print(f"API / client.submit: {api_rate / client_rate:.2f}x (target >= 1.0x)")
    print(f"load average: {os.getloadavg()[0]:.2f} (1 min), {os.cpu_count()} CPUs")
    return job_id


def poll_section(args: argparse.Namespace, port: int, key: str, job_id: str) -> None:
    latencies, wall = _poll(port, key, job_id, args.pollers, args.polls)
    print(f"\n2. GET /v1/jobs/{{id}} under {args.pollers} concurrent pollers, {args.polls} requests each")
    rows = [
        (
            len(latencies),
            f"{h.percentile(latencies, 50) * 1000:.1f}",
            f"{h.percentile(latencies, 99) * 1000:.1f}",
            f"{latencies[-1] * 1000:.1f}",
            f"{len(latencies) / wall:,.0f}",
        )
    ]
    h.print_table(("requests", "p50 ms", "p99 ms", "max ms", "requests/s"), rows)


def _poll(port: int, key: str, job_id: str, pollers: int, polls: int) -> tuple[list[float], float]:
    """Each poller one keep-alive connection, warmed first (connected, the API's key cache filled)."""
    get = ("GET", f"/v1/jobs/{job_id}", None, {"Authorization": f"Bearer {key}"})
    latencies, wall, _ = h.http_clients(port, pollers, polls, lambda client, i: get, warm=True)
    return latencies, wall


def serve(variant: str, port: int) -> None:
    """One API process (the bench starts two): as shipped, or with the key found without the store."""
    import uvicorn

    from api.app import create_app
    from api.auth import caller

    app = create_app()
    if variant == "no-lookup":
        from worker.store.api_keys import ApiKey

        keys = app.state.backend.keys.all()

        def remembered() -> ApiKey:
            return keys[0]

        app.dependency_overrides[caller] = remembered
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="info", access_log=False)
    print("stopped", flush=True)


def auth_section(args: argparse.Namespace, found: h.Stack, key: str) -> None:
    """GET /v1/jobs/{id} against two API processes over one database: ``lookup`` as shipped (one indexed read
    of the key per request) and ``no lookup`` (the key answered from memory, the best any cache could do)."""
    from worker.client import Client
    from worker.store.values import JobSpec

    job_id = "00000000-0000-4000-8000-000000000001"
    Client().store.create_job(JobSpec(job_id, "noop", "normal", 1), tenant="bench")
    ports = {"lookup": args.port, "no lookup": args.port + 1}
    env = found.env(api_check_processes="0")
    for name, port in ports.items():
        argv = h.python("bench.api", "--serve", name.replace(" ", "-"), "--port", str(port))
        h.Proc(argv, env, name, h.UVICORN_READY).wait_ready()

    for pollers in (int(p) for p in args.auth.split(",")):
        p50s: dict[str, list[float]] = {name: [] for name in ports}
        p99s: dict[str, list[float]] = {name: [] for name in ports}
        rates: dict[str, list[float]] = {name: [] for name in ports}
        for _ in range(args.rounds):
            for name, port in ports.items():
                latencies, wall = _poll(port, key, job_id, pollers, args.polls)
                p50s[name].append(h.percentile(latencies, 50) * 1000)
                p99s[name].append(h.percentile(latencies, 99) * 1000)
                rates[name].append(len(latencies) / wall)
        print(f"\nGET /v1/jobs/{{id}}: {pollers} pollers x {args.polls} requests, {args.rounds} rounds")
        rows = [
            (
                name,
                f"{statistics.median(p50s[name]):.2f}",
                f"{statistics.median(p99s[name]):.2f}",
                f"{statistics.median(rates[name]):,.0f}",
            )
            for name in ports
        ]
        h.print_table(("key", "p50 ms", "p99 ms", "requests/s"), rows)
        ratio = statistics.median(rates["lookup"]) / statistics.median(rates["no lookup"])
        extra = statistics.median(p50s["lookup"]) - statistics.median(p50s["no lookup"])
        print(f"lookup / no lookup requests/s: {ratio:.2f}x; p50 +{extra:.2f} ms per request")


if __name__ == "__main__":
    main()
