"""Figure 2 of bench/scheduling.py: priority lanes under saturation, through a real worker process.

A ``simulated`` model (a + b*n ms per batch) on Redis + PostgreSQL: a bulk backlog keeps the worker busy
while single-item jobs stream in, as ``high`` (lanes) or as ``bulk`` (plain FIFO); then a high flood with a
trickle of bulk jobs shows the starvation bound. Every figure is read back from the stored jobs and batch
records. Never asserts; owns its Redis database and PostgreSQL schema and cleans both up.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import redis
from sqlalchemy import Engine, create_engine, text

from bench import processes
from bench.processes import WorkerProcess, python_module
from bench.services import postgres_schema, redis_database

# The claim keys of the integration tests (database 0), so a test run and this bench never share a database.
MODEL = "simulated"


# -- services --------------------------------------------------------------------------------------


@dataclass
class Stack:
    broker_url: str
    database_url: str
    schema: str
    redis_db: int
    broker: redis.Redis
    db: Engine
    store: Any  # worker.store.results.ResultStore, imported once BATCHWORK_* point here

    def worker_env(self, settings: dict[str, Any]) -> dict[str, str]:
        env = processes.service_env(self.broker_url, self.database_url)
        for name, value in settings.items():
            env[f"BATCHWORK_{name.upper()}"] = value if isinstance(value, str) else json.dumps(value)
        return env

    def reset(self) -> None:
        """Between runs: no message, job, result or batch of the previous run is left."""
        self.broker.flushdb()
        with self.db.begin() as conn:
            conn.execute(text("TRUNCATE results, jobs, batches"))


@contextmanager
def stack(args: argparse.Namespace) -> Iterator[Stack]:
    if "worker.celery_app" in sys.modules:
        raise RuntimeError("worker.celery_app was imported before the bench set BATCHWORK_* (read once)")
    with (
        redis_database(args.redis_url, args.redis_db, "bench.scheduling") as (broker, broker_url),
        postgres_schema(args.postgres_url, "bench_sched") as (_admin, schema, database_url),
    ):
        db = create_engine(database_url)
        store = None
        try:
            for name in [k for k in os.environ if k.startswith("BATCHWORK_")]:
                del os.environ[name]
            os.environ.update(BATCHWORK_BROKER_URL=broker_url, BATCHWORK_DATABASE_URL=database_url)
            from worker.store.results import ResultStore
            from worker.store.schema import migrate

            migrate(database_url)
            store = ResultStore.from_url(database_url)
            number = int(broker_url.rsplit("/", 1)[1])
            yield Stack(broker_url, database_url, schema, number, broker, db, store)
        finally:
            processes.stop_all()
            if store is not None:
                store.close()
            if "worker.tasks" in sys.modules:
                sys.modules["worker.tasks"].job_store(database_url).close()
            db.dispose()


# -- knobs -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Knobs:
    base_ms: float
    per_item_ms: float
    bulk_n: int
    model_n: int
    model_t_ms: float

    def batching(self, bulk_lane: dict[str, Any] | None = None) -> dict[str, Any]:
        lanes = {"bulk": {"max_batch_size": self.bulk_n, **(bulk_lane or {})}}
        return {MODEL: {"max_batch_size": self.model_n, "max_wait_ms": self.model_t_ms, "lanes": lanes}}

    def settings(self, bulk_lane: dict[str, Any] | None = None) -> dict[str, Any]:
        return {
            "simulated_base_ms": str(self.base_ms),
            "simulated_per_item_ms": str(self.per_item_ms),
            "preload": [MODEL],
            "batching": self.batching(bulk_lane),
        }

    def policy(self, priority: str) -> Any:
        from worker.batching.policy import LanePolicy, lane_policy
        from worker.settings import BatchingSettings, LaneSettings

        chosen = BatchingSettings(lanes={"bulk": LaneSettings(max_batch_size=self.bulk_n)})
        return lane_policy(LanePolicy(self.model_n, self.model_t_ms / 1000), priority, chosen)

    def batch_ms(self, n: int) -> float:
        return self.base_ms + self.per_item_ms * n

    def bulk_items_per_s(self) -> float:
        return self.bulk_n / self.batch_ms(self.bulk_n) * 1000


def knobs_of(args: argparse.Namespace) -> Knobs:
    return Knobs(args.sim_base_ms, args.sim_per_item_ms, args.bulk_n, args.model_n, args.model_t_ms)


# -- measuring helpers -----------------------------------------------------------------------------

_BEGAN = time.monotonic()


def note(message: str) -> None:
    """Progress on stderr, so the tables on stdout stay clean."""
    print(f"  [{time.monotonic() - _BEGAN:6.1f} s] {message}", file=sys.stderr, flush=True)


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest rank; nan for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def start_worker(st: Stack, name: str, settings: dict[str, Any]) -> WorkerProcess:
    argv = python_module("worker.cli", "worker", "--loglevel=INFO", "--hostname", f"{name}@bench")
    worker = WorkerProcess(argv, st.worker_env(settings), name)
    worker.wait_ready()
    note(f"worker {name} ready")
    return worker


def texts(prefix: str, n: int) -> list[str]:
    return [f"{prefix} {i}" for i in range(n)]


def wait_done(st: Stack, job_id: str, at_least: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while (st.store.status(job_id).done or 0) < at_least and time.monotonic() < deadline:
        time.sleep(0.05)


def wait_finished(st: Stack, job_ids: Sequence[str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    pending = list(job_ids)
    while pending and time.monotonic() < deadline:
        pending = [j for j in pending if st.store.status(j).finished_at is None]
        time.sleep(0.1)


def latencies_ms(st: Stack, job_ids: Sequence[str]) -> tuple[list[float], int]:
    """finished_at - created_at of each finished job, and how many have not finished."""
    done, unfinished = [], 0
    for job_id in job_ids:
        status = st.store.status(job_id)
        if status is None or status.finished_at is None:
            unfinished += 1
        else:
            done.append((status.finished_at - status.created_at).total_seconds() * 1000)
    return done, unfinished


def batches_between(st: Stack, lane: str, start: float, end: float) -> list[Any]:
    """Stored batch records of ``lane`` that started in [start, end) (wall clock), oldest first."""
    records = st.store.recent_batches(limit=1_000_000)
    chosen = [b for b in records if b.lane == lane and start <= b.started_at.timestamp() < end]
    return sorted(chosen, key=lambda b: b.started_at)


def pace(start: float, rate_per_s: float, count: int) -> None:
    """Sleep until the ``count``-th event of a steady stream that began at ``start`` is due."""
    delay = start + count / rate_per_s - time.time()
    if delay > 0:
        time.sleep(delay)


# -- the stream runs -------------------------------------------------------------------------------


@dataclass
class StreamRun:
    name: str
    latencies_ms: list[float]
    unfinished: int
    alone_items_per_s: float
    with_items_per_s: float
    bulk_runs_ms: list[float]  # run time of each bulk batch during the stream
    high_batches: list[Any] = field(default_factory=list)
    offered_per_s: float = 0.0
    bulk_waits_ms: list[float] = field(default_factory=list)  # oldest-item wait of each bulk batch


def stream_run(st: Stack, args: argparse.Namespace, name: str, priority: str, bulk_lane: Any) -> StreamRun:
    """A bulk backlog, `alone_s` of bulk alone, then `stream_s` of single-item jobs at `priority`."""
    from worker.client import submit
    from worker.tasks import infer

    kn = knobs_of(args)
    alone_s = args.alone_s if priority == "high" else 0.0
    busy_s = 1.0 + alone_s + args.stream_s + 3.0
    worker = start_worker(st, name, kn.settings(bulk_lane))
    try:
        backlog = submit(MODEL, texts("bulk", int(kn.bulk_items_per_s() * busy_s)), priority="bulk")
        wait_done(st, backlog, 1, timeout_s=30)
        note(f"{name}: backlog running")
        alone0 = time.time() + 1.0  # past the first batches
        s0 = alone0 + alone_s
        time.sleep(max(0.0, s0 - time.time()))
        ids = []
        count = int(args.stream_rate * args.stream_s)
        for i in range(count):
            pace(s0, args.stream_rate, i)
            ids.append(infer.delay(model=MODEL, inputs=[f"urgent {i}"], priority=priority).id)
        s1 = time.time()
        note(f"{name}: stream sent, waiting for its jobs")
        wait_finished(st, ids, timeout_s=busy_s + 60)
        note(f"{name}: done")
        lat, unfinished = latencies_ms(st, ids)
        bulk_with = batches_between(st, "bulk", s0, s1)
        alone = batches_between(st, "bulk", alone0, s0) if alone_s else []
        return StreamRun(
            name,
            lat,
            unfinished,
            sum(b.size for b in alone) / alone_s if alone_s else float("nan"),
            sum(b.size for b in bulk_with) / (s1 - s0),
            [b.run_ms for b in bulk_with],
            batches_between(st, "high", s0, time.time() + 1),
            count / (s1 - s0),
            [b.wait_ms for b in bulk_with],
        )
    finally:
        worker.stop()
        st.reset()


@dataclass
class FloodRun:
    offered_high_per_s: float
    served_high_per_s: float
    bulk_batches: list[Any]
    bulk_latencies_ms: list[float]
    bulk_unfinished: int
    flood_s: float


def flood_run(st: Stack, args: argparse.Namespace) -> FloodRun:
    """High jobs of N_high items each, faster than the worker drains them, and a trickle of bulk jobs."""
    from worker.tasks import infer

    kn = knobs_of(args)
    high_n = kn.policy("high").max_batch_size
    capacity = high_n / kn.batch_ms(high_n) * 1000
    jobs_per_s = args.flood_factor * capacity / high_n
    worker = start_worker(st, "flood", kn.settings())
    try:
        f0 = time.time()
        high, sent = 0, 0
        bulk: list[str] = []
        while (now := time.time()) < f0 + args.flood_s:
            if len(bulk) * args.trickle_every_s <= now - f0:
                inputs = texts(f"bulk {len(bulk)}", args.trickle_items)
                bulk.append(infer.delay(model=MODEL, inputs=inputs, priority="bulk").id)
            pace(f0, jobs_per_s, high)
            infer.delay(model=MODEL, inputs=texts(f"flood {high}", high_n), priority="high")
            high += 1
            sent += high_n
        f1 = time.time()
        wait_finished(st, bulk, timeout_s=args.flood_s + 60)
        lat, unfinished = latencies_ms(st, bulk)
        served = sum(b.size for b in batches_between(st, "high", f0, f1))
        return FloodRun(
            sent / (f1 - f0),
            served / (f1 - f0),
            batches_between(st, "bulk", f0, time.time() + 1),
            lat,
            unfinished,
            f1 - f0,
        )
    finally:
        worker.stop()
        st.reset()
