"""What a bench.pipeline or bench.scaleout figure runs on, and how it measures it: the bench's own Redis
database and migrated PostgreSQL schema, batchwork worker processes, result rows read back, printed tables.

Never imports a worker module before the BATCHWORK_* settings point at the bench's services (read once).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import redis
from sqlalchemy import Engine, create_engine, text

from bench import processes
from bench.processes import WorkerProcess, python_module
from bench.services import postgres_schema, redis_database

# How often a waiting bench looks at the database or a job: a phase's end is seen within 20 ms.
POLL_S = 0.02


# -- set-up ------------------------------------------------------------------------------------


@dataclass
class Services:
    broker_url: str
    database_url: str
    schema: str
    db: Engine  # on the bench schema
    broker: redis.Redis
    redis_db: int
    worker_settings: dict[str, str]  # --worker-setting, for batchwork workers

    def worker_env(self, **settings: Any) -> dict[str, str]:
        env = processes.service_env(self.broker_url, self.database_url)
        env.update(BENCH_BROKER_URL=self.broker_url, BENCH_DATABASE_URL=self.database_url)
        for name, value in settings.items():
            env[name] = value if isinstance(value, str) else json.dumps(value)
        return env

    def truncate(self) -> None:
        with self.db.begin() as conn:
            conn.execute(text("TRUNCATE results, jobs, batches, bench_results"))


@contextmanager
def services(args: argparse.Namespace) -> Iterator[Services]:
    with (
        redis_database(args.redis_url, args.redis_db, "bench") as (client, broker_url),
        postgres_schema(args.postgres_url, "bench") as (_admin, schema, database_url),
    ):
        db = create_engine(database_url)
        extra = dict(setting.split("=", 1) for setting in args.worker_setting)
        extra = {
            f"BATCHWORK_{name.upper().removeprefix('BATCHWORK_')}": value for name, value in extra.items()
        }
        number = int(broker_url.rsplit("/", 1)[1])
        found = Services(broker_url, database_url, schema, db, client, number, extra)
        try:
            _prepare_process(found)
            yield found
        finally:
            processes.stop_all()
            db.dispose()
            if "worker.store.results" in sys.modules:
                sys.modules["worker.store.results"].ResultStore.for_url(database_url).close()


def _prepare_process(found: Services) -> None:
    """Migrate, and point this process's settings at the bench services before any worker module loads."""
    for name in [k for k in os.environ if k.startswith(("BATCHWORK_", "BENCH_"))]:
        del os.environ[name]
    os.environ.update(
        BATCHWORK_BROKER_URL=found.broker_url,
        BATCHWORK_DATABASE_URL=found.database_url,
        BENCH_BROKER_URL=found.broker_url,
        BENCH_DATABASE_URL=found.database_url,
    )
    if "worker.settings" in sys.modules:
        raise RuntimeError(
            "worker modules were imported before the bench set BATCHWORK_* (settings read once)"
        )
    from bench.baselines import metadata
    from worker.store.schema import migrate

    migrate(found.database_url)
    metadata.create_all(found.db)


# -- measuring helpers -------------------------------------------------------------------------


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    cells = [[_cell(value) for value in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    print(_line(headers, widths))
    print(_line(["-" * w for w in widths], widths))
    for row in cells:
        print(_line(row, widths))


def _line(cells: Sequence[str], widths: Sequence[int]) -> str:
    """First column left-aligned, the numbers right-aligned."""
    padded = [c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))]
    return "  " + "  ".join(padded)


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"
    return str(value)


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if a == a and b == b and b > 0 else "n/a"


def print_problems(workers: Sequence[WorkerProcess], limit: int = 20) -> None:
    for worker in workers:
        lines = worker.problems()
        if not lines:
            print(f"  worker {worker.name}: no warnings or errors logged")
            continue
        print(f"  worker {worker.name}: {len(lines)} warning/error lines, first {min(limit, len(lines))}:")
        for line in lines[:limit]:
            print(f"    {line[:300]}")


def epoch(value: datetime | None) -> float:
    return float("nan") if value is None else value.timestamp()


@dataclass
class Rows:
    """What a results table holds: how many rows, when the first and last were written."""

    count: int
    first: float
    last: float
    after_first: int  # rows written after the first write (the first batch's rows are not)

    def commit_rate(self) -> float:
        span = self.last - self.first
        return self.after_first / span if span > 0 else float("nan")


def rows(services: Services, table: str) -> Rows:
    query = text(
        f"SELECT count(*), min(created_at), max(created_at), "
        f"count(*) FILTER (WHERE created_at > (SELECT min(created_at) FROM {table})) FROM {table}"
    )
    with services.db.connect() as conn:
        count, first, last, after = conn.execute(query).one()
    return Rows(count, epoch(first), epoch(last), after)


def wait_rows(services: Services, table: str, total: int, timeout_s: float) -> Rows:
    """Poll until ``total`` rows are stored (or the timeout); the caller reads the write times."""
    deadline = time.monotonic() + timeout_s
    query = text(f"SELECT count(*) FROM {table}")
    while True:
        with services.db.connect() as conn:
            count = conn.execute(query).scalar_one()
        if count >= total or time.monotonic() > deadline:
            break
        time.sleep(POLL_S)
    found = rows(services, table)
    if found.count < total:
        print(f"  !! timed out after {timeout_s:.0f} s with {found.count}/{total} rows in {table}")
    return found


def wait_job(job_id: str, timeout_s: float) -> Any:
    from worker.client import status
    from worker.store.values import FINISHED_STATES as FINISHED

    deadline = time.monotonic() + timeout_s
    while (job := status(job_id)).state not in FINISHED:
        if time.monotonic() > deadline:
            print(f"  !! job {job_id} still {job.state} after {timeout_s:.0f} s ({job.done}/{job.total})")
            return job
        time.sleep(POLL_S)
    return job


def batch_stats(services: Services) -> tuple[int, float, float, float]:
    """Batches stored so far: count, mean size, total run_ms, padded/real tokens."""
    query = text(
        "SELECT count(*), avg(size), sum(run_ms), sum(padded_tokens)::float / nullif(sum(real_tokens), 0) "
        "FROM batches"
    )
    with services.db.connect() as conn:
        count, size, run_ms, padding = conn.execute(query).one()
    return count, float(size or 0), float(run_ms or 0), float(padding or float("nan"))


def batchwork_worker(services: Services, name: str, **settings: Any) -> WorkerProcess:
    env = services.worker_env(**{f"BATCHWORK_{k.upper()}": v for k, v in settings.items()})
    env.update(services.worker_settings)
    argv = python_module("worker.cli", "worker", "--loglevel=INFO", "--hostname", f"{name}@bench")
    return WorkerProcess(argv, env, name)


def cores(cpu: processes.CpuMeter) -> list[str]:
    """Table cells: cores used by the bench process, the workers and everyone else."""
    return [f"{cpu.cores[key]:.2f}" for key in ("bench", "workers", "others")]


# -- profiling the bench process (--profile-producer) ------------------------------------------


def producer_profiler(enabled: bool) -> Any:
    if not enabled:
        return None
    import cProfile

    return cProfile.Profile()


def print_profile(profiler: Any, what: str = "submit()") -> None:
    import io
    import pstats

    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out).sort_stats("cumulative")
    stats.print_stats(25)
    print(f"  cProfile of {what} in the bench process (cumulative):")
    print("\n".join("    " + line for line in out.getvalue().splitlines() if line.strip()))
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(15)
    print(f"  cProfile of {what} in the bench process (self time):")
    print("\n".join("    " + line for line in out.getvalue().splitlines() if line.strip()))
