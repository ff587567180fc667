"""Figure 2 of bench.pipeline: noop, many single-item calls: batchwork ``infer.delay`` vs plain Celery vs
celery-batches (bench/baselines.py), each alone on the same Redis and PostgreSQL, drained and end to end.

Imports worker modules only inside functions, once bench.stack has pointed BATCHWORK_* at the bench.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bench import processes, spy
from bench.processes import WorkerProcess, python_module
from bench.stack import (
    Rows,
    Services,
    batch_stats,
    batchwork_worker,
    cores,
    print_problems,
    print_profile,
    print_table,
    producer_profiler,
    ratio,
    wait_rows,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("figure 2: noop, many single-item calls")
    g.add_argument("--calls", type=int, default=None, help="items, one call each (default 5000, quick 2000)")
    g.add_argument("--plain-pool", default="prefork", choices=["prefork", "solo", "threads"])
    g.add_argument("--plain-concurrency", type=int, default=2)
    g.add_argument(
        "--plain-prefetch", type=int, default=4, help="worker_prefetch_multiplier (Celery's default)"
    )
    g.add_argument("--flush-every", type=int, default=256, help="celery-batches flush_every")
    g.add_argument("--flush-interval-s", type=float, default=0.05, help="celery-batches flush_interval")
    g.add_argument(
        "--batches-prefetch", type=int, default=1024, help="celery-batches worker_prefetch_multiplier"
    )


def fill_defaults(args: argparse.Namespace) -> None:
    """The size --quick shrinks, where the command line gives none."""
    args.calls = args.calls or (2000 if args.quick else 5000)


@dataclass(frozen=True)
class System:
    name: str
    table: str
    start: Callable[[], WorkerProcess]
    publish: Callable[[int, str], object]


def run(args: argparse.Namespace, services: Services) -> None:
    from bench.baselines import BATCHES_QUEUE, PLAIN_QUEUE, batches_store, plain_store
    from worker.tasks import infer

    items = [f"item {i}: the quick brown fox jumps over the lazy dog" for i in range(args.calls)]
    print(
        f"\n== 2. noop, {len(items)} single-item calls, each system alone on the same Redis db "
        f"{services.redis_db} and PostgreSQL schema {services.schema}"
    )
    print("  batchwork: infer.delay(model='noop', inputs=[text]); worker `batchwork worker`, noop's own N/T")
    print(
        f"  plain: one task per item, one INSERT each; "
        f"celery -P {args.plain_pool} -c {args.plain_concurrency} "
        f"--prefetch-multiplier {args.plain_prefetch}, acks_late, JSON"
    )
    print(
        f"  celery-batches: flush_every={args.flush_every} "
        f"flush_interval={args.flush_interval_s:g} s, one bulk "
        f"INSERT per flush; celery -P solo --prefetch-multiplier {args.batches_prefetch}, acks_late, JSON"
    )

    def celery_worker(name: str, queue: str, *options: str, **env: Any) -> WorkerProcess:
        argv = python_module(
            "celery",
            "-A",
            "bench.baselines",
            "worker",
            "-Q",
            queue,
            "--loglevel=INFO",
            "--hostname",
            f"{name}@bench",
            "--without-mingle",
            "--without-gossip",
            "--without-heartbeat",
            *options,
        )
        return WorkerProcess(argv, services.worker_env(**env), name)

    systems = [
        System(
            "batchwork",
            "results",
            lambda: batchwork_worker(services, "noop-calls"),
            lambda i, item: infer.delay(model="noop", inputs=[item]),
        ),
        System(
            "plain",
            "bench_results",
            lambda: celery_worker(
                "plain",
                PLAIN_QUEUE,
                "-P",
                args.plain_pool,
                "-c",
                str(args.plain_concurrency),
                "--prefetch-multiplier",
                str(args.plain_prefetch),
            ),
            lambda i, item: plain_store.delay(i, item),
        ),
        System(
            "celery-batches",
            "bench_results",
            lambda: celery_worker(
                "batches",
                BATCHES_QUEUE,
                "-P",
                "solo",
                "--prefetch-multiplier",
                str(args.batches_prefetch),
                BENCH_FLUSH_EVERY=str(args.flush_every),
                BENCH_FLUSH_INTERVAL_S=str(args.flush_interval_s),
            ),
            lambda i, item: batches_store.delay(i, item),
        ),
    ]
    table: list[list[object]] = []
    rates: dict[str, tuple[float, float]] = {}
    workers: list[WorkerProcess] = []
    for system in systems:
        rates[system.name] = measure_calls(args, services, system, items, table, workers)
    print_table(
        [
            "system",
            "phase",
            "publish items/s",
            "items/s",
            "items/s first->last write",
            "wall s",
            "batches (mean size)",
            "CPU worker",
            "CPU others",
        ],
        table,
    )
    e2e = {name: r[0] for name, r in rates.items()}
    drain = {name: r[1] for name, r in rates.items()}
    print_table(
        ["ratio", "end-to-end", "drain (pre-filled queue)", "target"],
        [
            [
                "batchwork / celery-batches",
                ratio(e2e["batchwork"], e2e["celery-batches"]),
                ratio(drain["batchwork"], drain["celery-batches"]),
                "end-to-end >= 3x, drain >= 5x",
            ],
            [
                "batchwork / plain",
                ratio(e2e["batchwork"], e2e["plain"]),
                ratio(drain["batchwork"], drain["plain"]),
                "",
            ],
        ],
    )
    print(
        "  end-to-end: from the first publish until the last result row is written, worker already running;"
    )
    print(
        "  drain: everything published with no worker, then from the worker's 'ready.' line to the last row."
    )
    print_problems(workers)


def measure_calls(
    args: argparse.Namespace,
    services: Services,
    system: System,
    items: list[str],
    table: list[list[object]],
    workers: list[WorkerProcess],
) -> tuple[float, float]:
    """Drain a pre-filled queue, then run end to end with the same worker; (end-to-end, drain) items/s."""
    services.truncate()
    started = time.time()
    for i, item in enumerate(items):
        system.publish(i, item)
    publish_rate = len(items) / (time.time() - started)
    worker = system.start()
    workers.append(worker)
    try:
        ready = worker.wait_ready()
        spied = spy.record(worker.pid, args.py_spy, f"calls-{system.name}-drain", args.py_spy_gil)
        with spied, processes.CpuMeter(worker) as cpu:
            found = wait_rows(services, system.table, len(items), args.timeout_s)
        _explain_timeout(services, worker, found.count, len(items))
        drain = _append_row(table, services, system, "drain", publish_rate, found, ready, cpu)
        services.truncate()
        e2e = _calls_end_to_end(args, services, system, items, worker, table)
    finally:
        worker.stop()
    return e2e, drain


def _calls_end_to_end(
    args: argparse.Namespace,
    services: Services,
    system: System,
    items: list[str],
    worker: WorkerProcess,
    table: list[list[object]],
) -> float:
    profiler = producer_profiler(args.profile_producer and system.name == "batchwork")
    spied = spy.record(worker.pid, args.py_spy, f"calls-{system.name}-e2e", args.py_spy_gil)
    with spied, processes.CpuMeter(worker) as cpu:
        started = time.time()
        if profiler:
            profiler.enable()
        for i, item in enumerate(items):
            system.publish(i, item)
        if profiler:
            profiler.disable()
        published = time.time()
        found = wait_rows(services, system.table, len(items), args.timeout_s)
    _explain_timeout(services, worker, found.count, len(items))
    publish_rate = len(items) / (published - started)
    e2e = _append_row(table, services, system, "end-to-end", publish_rate, found, started, cpu)
    if profiler:
        print_profile(profiler, f"{len(items)} infer.delay calls")
    return e2e


def _append_row(
    table: list[list[object]],
    services: Services,
    system: System,
    phase: str,
    publish_rate: float,
    found: Rows,
    began: float,
    cpu: processes.CpuMeter,
) -> float:
    """Adds a phase's row to the table; its items/s (returned) run from ``began`` to the last row written."""
    wall_s = found.last - began
    rate = found.count / wall_s
    cells = [publish_rate, rate, found.commit_rate(), f"{wall_s:.2f}", _batches(services, system)]
    table.append([system.name, phase, *cells, *cores(cpu)[1:]])
    return rate


def _explain_timeout(services: Services, worker: WorkerProcess, stored: int, total: int) -> None:
    """After a timed-out phase: what is still queued or held unacked, and the worker's last words."""
    if stored >= total:
        return
    queues = {key.decode(): services.broker.llen(key) for key in services.broker.scan_iter(match="*bench*")}
    queues |= {
        key.decode(): services.broker.llen(key) for key in services.broker.scan_iter(match="batchwork.*")
    }
    unacked = services.broker.hlen("unacked")
    alive = worker.proc.poll() is None
    print(f"  !! {worker.name}: alive={alive}, queue lengths {queues}, unacked {unacked}; log tail:")
    for line in worker.log[-15:]:
        print(f"     {line[:250]}")


def _batches(services: Services, system: System) -> str:
    if system.name != "batchwork":
        return ""
    count, size, _, _ = batch_stats(services)
    return f"{count} ({size:.1f})"
