"""What looking every request's key up in the store costs the API, side by side in one run on real Redis +
PostgreSQL: `GET /v1/jobs/{id}` from N concurrent pollers against two API processes over the same database,

- ``lookup``: the API as shipped, one indexed read of the key per request (a revoked key is refused by the
  very next request), and
- ``no lookup``: the same app with the key dependency answered from memory, the cost a cache had (the best
  any cache could do; the 2 s cache this replaced let a revoked key through for up to 2 s).

Rounds alternate between the two; medians over rounds. Prints tables, never asserts. From the repository
root: ``python -m bench.api_auth [--pollers 1,16] [--polls 300] [--rounds 3]``.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
from collections.abc import Sequence

from bench.api import _percentile, _point_settings_at, _poll, print_table
from bench.processes import WorkerProcess, python_module
from bench.services import postgres_schema, redis_database

UVICORN_READY = re.compile(r"Uvicorn running on")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pollers", default="1,16", help="concurrent pollers, one table row each")
    parser.add_argument("--polls", type=int, default=300, help="requests per poller per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--port", type=int, default=8771, help="lookup on PORT, no lookup on PORT+1")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379")
    parser.add_argument("--redis-db", type=int, default=12)
    parser.add_argument("--postgres-url", default="postgresql+psycopg://root@127.0.0.1:5432/test")
    parser.add_argument("--serve", choices=("lookup", "no-lookup"), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def serve(variant: str, port: int) -> None:
    """One API process (the bench starts two): as shipped, or with the key found without the store."""
    import uvicorn

    from api.app import create_app
    from api.auth import caller

    app = create_app()
    if variant == "no-lookup":
        from worker.store.keys import ApiKey

        keys = app.state.backend.keys.all()

        def remembered() -> ApiKey:
            return keys[0]

        app.dependency_overrides[caller] = remembered
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="info", access_log=False)
    print("stopped", flush=True)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.serve:
        serve(args.serve, args.port)
        return
    with (
        redis_database(args.redis_url, args.redis_db, "bench-api-auth") as (_broker, broker_url),
        postgres_schema(args.postgres_url, "bench") as (_admin, _schema, database_url),
    ):
        _point_settings_at(broker_url, database_url)
        from worker.client import Client
        from worker.store.keys import KeyStore
        from worker.store.schema import migrate

        migrate(database_url)
        client = Client()
        key = KeyStore(client.store.engine).create("bench")[1]
        from worker.store.values import JobSpec

        job_id = "00000000-0000-4000-8000-000000000001"
        client.store.create_job(JobSpec(job_id, "noop", "normal", 1), tenant="bench")
        env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHWORK_")}
        env.update(BATCHWORK_BROKER_URL=broker_url, BATCHWORK_DATABASE_URL=database_url, PYTHONUNBUFFERED="1")
        env.update(BATCHWORK_API_CHECK_PROCESSES="0")
        ports = {"lookup": args.port, "no lookup": args.port + 1}
        servers = [
            WorkerProcess(
                python_module("bench.api_auth", "--serve", variant.replace(" ", "-"), "--port", str(port)),
                env,
                variant,
                UVICORN_READY,
            )
            for variant, port in ports.items()
        ]
        try:
            for server in servers:
                server.wait_ready()
            measure(args, ports, key, job_id)
        finally:
            for server in servers:
                server.stop()


def measure(args: argparse.Namespace, ports: dict[str, int], key: str, job_id: str) -> None:
    for pollers in (int(p) for p in args.pollers.split(",")):
        p50s: dict[str, list[float]] = {name: [] for name in ports}
        p99s: dict[str, list[float]] = {name: [] for name in ports}
        rates: dict[str, list[float]] = {name: [] for name in ports}
        for _ in range(args.rounds):
            for name, port in ports.items():
                latencies, wall = _poll(port, key, job_id, pollers, args.polls)
                latencies.sort()
                p50s[name].append(_percentile(latencies, 50) * 1000)
                p99s[name].append(_percentile(latencies, 99) * 1000)
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
        print_table(("key", "p50 ms", "p99 ms", "requests/s"), rows)
        ratio = statistics.median(rates["lookup"]) / statistics.median(rates["no lookup"])
        extra = statistics.median(p50s["lookup"]) - statistics.median(p50s["no lookup"])
        print(f"lookup / no lookup requests/s: {ratio:.2f}x; p50 +{extra:.2f} ms per request")


if __name__ == "__main__":
    sys.exit(main())
