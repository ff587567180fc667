"""The HTTP API's overhead, side by side on servers of the bench's own, no worker (bench/README.md): a large
NDJSON POST to `batchwork api` vs ``client.submit`` of the same items, alternating, and ``GET /v1/jobs/{id}``
under concurrent pollers; ``--auth 1,16`` instead: that GET with the key looked up per request vs from memory.
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
    p.add_argument("--auth", default="", metavar="POLLERS", help="instead: the key lookup's cost (e.g. 1,16)")
    p.add_argument("--rounds", type=int, default=3, help="--auth: rounds, alternating")
    p.add_argument("--serve", nargs=2, help=argparse.SUPPRESS)  # --auth's servers: lookup|no-lookup PORT
    args = p.parse_args(argv)
    args.polls = args.polls or (300 if args.auth else 40)
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.serve:
        return serve(*args.serve)
    h.header("bench.api", args)
    with h.stack() as found:
        from worker.client import Client
        from worker.store.api_keys import KeyStore

        key = KeyStore(Client().store.engine).create("bench")[1]
        if args.auth:
            return auth_section(args, found, key)
        # Room for every submit of the run; the bench measures speed, not the limits.
        limits = {
            "api_max_tenant_items": str(args.items * (args.repeats + 1)),
            "api_max_queue_depth": "1000000",
        }
        port = free_port()  # two benches at once (or one just ended) must not meet on one port
        api = h.api(found, port, **limits)
        api.wait_ready()
        job_id = submit_section(args, f"http://127.0.0.1:{port}", key, api)
        latencies, wall = poll(port, key, job_id, args.pollers, args.polls)
        print(f"\n2. GET /v1/jobs/{{id}} under {args.pollers} concurrent pollers, {args.polls} requests each")
        ms = [f"{h.percentile(latencies, q) * 1000:.1f}" for q in (50, 99, 100)]
        h.print_table(("requests", "p50 ms", "p99 ms", "max ms", "requests/s"),
                      [(len(latencies), *ms, f"{len(latencies) / wall:,.0f}")])  # fmt: skip
        h.print_problems([api])


def submit_section(args: argparse.Namespace, url: str, key: str, api: h.Process) -> str:
    from worker.client import Client

    inputs = [
        {"id": f"doc-{i}", "text": f"document number {i} about batch inference"} for i in range(args.items)
    ]
    body = b"".join(orjson.dumps(item) + b"\n" for item in inputs)
    client = Client()
    http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=600)
    # Wall and CPU seconds of each path's own processes: this one for client.submit; the API and its checking
    # processes for the POST (Redis and PostgreSQL left out of both). On a loaded machine CPU moves less.
    runs: dict[str, list[tuple[float, float]]] = {"POST /v1/jobs (NDJSON)": [], "client.submit": []}
    job_id = ""
    for _ in range(args.repeats):
        started, cpu = time.perf_counter(), time.process_time()
        client.submit(MODEL, inputs)
        runs["client.submit"].append((time.perf_counter() - started, time.process_time() - cpu))
        started, cpu = time.perf_counter(), h.group_cpu_s(api.pid)
        answer = http.post("/v1/jobs", params={"model": MODEL}, content=body,
                           headers={"Content-Type": "application/x-ndjson"})  # fmt: skip
        runs["POST /v1/jobs (NDJSON)"].append((time.perf_counter() - started, h.group_cpu_s(api.pid) - cpu))
        if answer.status_code != 202:
            raise RuntimeError(f"the API refused the submit: {answer.status_code} {answer.text}")
        job_id = answer.json()["id"]
    print(f"\n1. submit of {args.items:,} {MODEL} items ({len(body) / 2**20:.1f} MiB of NDJSON), no worker")
    rates = {name: args.items / statistics.median(wall for wall, _ in pairs) for name, pairs in runs.items()}
    h.print_table(("path", "seconds per run", "items/s (median)", "CPU s per run"),
                  [(name, " ".join(f"{w:.2f}" for w, _ in pairs), f"{rates[name]:,.0f}",
                    " ".join(f"{c:.2f}" for _, c in pairs)) for name, pairs in runs.items()])  # fmt: skip
    api_rate, client_rate = rates.values()
    print(f"API / client.submit: {api_rate / client_rate:.2f}x (target >= 1.0x)")
    print(f"load average: {os.getloadavg()[0]:.2f} (1 min), {os.cpu_count()} CPUs")
    return job_id


def poll(port: int, key: str, job_id: str, pollers: int, polls: int) -> tuple[list[float], float]:
    """Each poller one keep-alive connection, warmed first (connected, the API's key cache filled)."""
    get = ("GET", f"/v1/jobs/{job_id}", None, {"Authorization": f"Bearer {key}"})
    latencies, wall, _ = h.http_clients(port, pollers, polls, lambda client, i: get, warm=True)
    return latencies, wall


def serve(variant: str, port: str) -> None:
    """One API process of --auth's two: as shipped, or with the key found without the store."""
    import uvicorn

    from api.app import create_app
    from api.auth import caller

    app = create_app()
    if variant == "no-lookup":
        keys = app.state.backend.keys.all()
        app.dependency_overrides[caller] = lambda: keys[0]
    uvicorn.run(app, host="127.0.0.1", port=int(port), log_level="info", access_log=False)


def auth_section(args: argparse.Namespace, found: h.Stack, key: str) -> None:
    """GET /v1/jobs/{id} against two API processes over one database: ``lookup`` as shipped (one indexed read
    of the key per request) and ``no lookup`` (the key answered from memory, the best any cache could do)."""
    from worker.client import Client
    from worker.store.values import JobSpec

    job_id = "00000000-0000-4000-8000-000000000001"
    Client().store.create_job(JobSpec(job_id, "noop", "normal", 1), tenant="bench")
    ports = {"lookup": free_port(), "no lookup": free_port()}
    for name, port in ports.items():
        argv = h.python("bench.api", "--serve", name.replace(" ", "-"), str(port))
        h.start(argv, found.env(api_check_processes="0"), name, h.UVICORN_READY).wait_ready()
    for pollers in (int(p) for p in args.auth.split(",")):
        runs: dict[str, list[tuple[float, float, float]]] = {name: [] for name in ports}  # p50, p99 ms, rate
        for _ in range(args.rounds):
            for name, port in ports.items():
                latencies, wall = poll(port, key, job_id, pollers, args.polls)
                runs[name].append(
                    (*(h.percentile(latencies, q) * 1000 for q in (50, 99)), len(latencies) / wall)
                )
        medians = {name: [statistics.median(column) for column in zip(*rows, strict=True)]
                   for name, rows in runs.items()}  # fmt: skip
        print(f"\nGET /v1/jobs/{{id}}: {pollers} pollers x {args.polls} requests, {args.rounds} rounds")
        rows = [(name, f"{m[0]:.2f}", f"{m[1]:.2f}", f"{m[2]:,.0f}") for name, m in medians.items()]
        h.print_table(("key", "p50 ms", "p99 ms", "requests/s"), rows)
        (p50, _, rate), (free_p50, _, free_rate) = medians["lookup"], medians["no lookup"]
        print(
            f"lookup / no lookup requests/s: {rate / free_rate:.2f}x; p50 +{p50 - free_p50:.2f} ms a request"
        )


if __name__ == "__main__":
    main()
