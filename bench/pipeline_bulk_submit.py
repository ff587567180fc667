"""Figure 3 of bench.pipeline: noop, one large ``submit``: items/s end to end, and the time inside submit
(its steps timed apart) against the worker's drain.

Imports worker modules only inside functions, once bench.stack has pointed BATCHWORK_* at the bench.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy import text

from bench import processes, spy
from bench.stack import (
    Services,
    batch_stats,
    batchwork_worker,
    epoch,
    print_problems,
    print_profile,
    print_table,
    producer_profiler,
    wait_job,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("figure 3: noop, one large submit")
    g.add_argument("--submit-items", type=int, default=None, help="default 200000, quick 50000")
    g.add_argument("--noop-n", type=int, default=None, help="noop max_batch_size (default: the model's own)")


def fill_defaults(args: argparse.Namespace) -> None:
    """The size --quick shrinks, where the command line gives none."""
    args.submit_items = args.submit_items or (50_000 if args.quick else 200_000)


class Stopwatch:
    """Accumulates the time spent in wrapped functions (the bench wraps names in worker.client)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def wrap(self, name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*a: Any, **kw: Any) -> Any:
            started = time.perf_counter()
            try:
                return function(*a, **kw)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - started
                self.calls[name] = self.calls.get(name, 0) + 1

        return timed


# The steps of Client.submit timed apart: checking every item, the job's row in SQL, the messages.
SUBMIT_PARTS = ("check", "register", "publish")


def run(args: argparse.Namespace, services: Services) -> None:
    from worker.client import Client, submit
    from worker.settings import get_settings

    total = args.submit_items
    settings = get_settings()
    knobs = {"noop": {"max_batch_size": args.noop_n}} if args.noop_n else {}
    print(
        f"\n== 3. noop, one submit of {total:,} items (submit_chunk_size={settings.submit_chunk_size}, "
        f"noop N={args.noop_n or 'model default'}, prefetch_count={settings.prefetch_count})"
    )
    inputs = [f"item {i}: the quick brown fox jumps over the lazy dog" for i in range(total)]
    worker = batchwork_worker(services, "noop-submit", batching=knobs)
    try:
        worker.wait_ready()
        wait_job(submit("noop", inputs[:2000]), args.timeout_s)  # warm-up: connections, first batches
        services.truncate()

        watch = Stopwatch()
        originals = {name: getattr(Client, name) for name in SUBMIT_PARTS}
        for name, function in originals.items():
            setattr(Client, name, watch.wrap(name, function))
        profiler = producer_profiler(args.profile_producer)
        try:
            with (
                spy.record(worker.pid, args.py_spy, "submit-worker", args.py_spy_gil),
                processes.CpuMeter(worker) as cpu,
            ):
                started = time.time()
                profiler.enable() if profiler else None
                job_id = submit("noop", inputs)
                profiler.disable() if profiler else None
                submitted = time.time()
                job = wait_job(job_id, args.timeout_s)
        finally:
            for name, function in originals.items():
                setattr(Client, name, function)
        finished = epoch(job.finished_at)
        count, size, run_ms, _ = batch_stats(services)
        first_batch = _first_batch_start(services)
        submit_s = submitted - started
        parts = [(name, watch.seconds.get(name, 0.0), watch.calls.get(name, 0)) for name in SUBMIT_PARTS]
        other = submit_s - sum(seconds for _, seconds, _ in parts)
        print_table(
            ["in submit()", "s", "calls", "share"],
            [[name, f"{s:.3f}", calls, f"{s / submit_s:.0%}"] for name, s, calls in parts]
            + [
                ["other (chunking, producer)", f"{other:.3f}", "", f"{other / submit_s:.0%}"],
                ["submit total", f"{submit_s:.3f}", 1, "100%"],
            ],
        )
        print_table(
            ["phase", "s", "items/s"],
            [
                ["submit() call", f"{submit_s:.2f}", total / submit_s],
                ["after submit returned, until finished", f"{finished - submitted:.2f}", ""],
                [
                    "worker: first batch start -> finished",
                    f"{finished - first_batch:.2f}",
                    job.done / (finished - first_batch),
                ],
                [
                    "end to end: submit call -> succeeded",
                    f"{finished - started:.2f}",
                    job.done / (finished - started),
                ],
            ],
        )
        print(
            f"  job {job.state}: {job.done} done, {job.failed} failed; "
            f"{count} batches, mean size {size:.0f}, "
            f"model run {run_ms / 1000:.2f} s in all; CPU (cores) worker {cpu.cores['workers']:.2f}, "
            f"bench {cpu.cores['bench']:.2f}, others {cpu.cores['others']:.2f}"
        )
        print(
            f"  end to end {job.done / (finished - started):,.0f} items/s (target >= 150,000); worker CPU "
            f"{cpu.seconds['workers'] / max(1, job.done) * 1e6:.1f} µs per item (target <= 5)"
        )
        if profiler:
            print_profile(profiler)
    finally:
        worker.stop()
    print_problems([worker])
    services.truncate()


def _first_batch_start(services: Services) -> float:
    with services.db.connect() as conn:
        return epoch(conn.execute(text("SELECT min(started_at) FROM batches")).scalar_one())
