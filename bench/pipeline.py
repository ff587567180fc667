"""End-to-end throughput of batchwork on real Redis + PostgreSQL, each figure a ratio measured in one run.

1. MiniLM: our model in a plain loop (raw) vs the same corpus through submit -> worker -> SQL (pipeline).
2. noop, many single-item calls: batchwork ``infer.delay`` vs plain Celery vs celery-batches.
3. noop, one large ``submit``: items/s, and the time inside submit vs the worker's drain.
Prints tables, never asserts, cleans up its Redis database, PostgreSQL schema and workers. Run from the
repository root: ``python -m bench.pipeline [--quick]``. This module only parses the flags and runs the
figures; each figure is a module of its own (pipeline_minilm, pipeline_single_calls, pipeline_bulk_submit)
on the services and measuring helpers of bench/stack.py.
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from bench import pipeline_bulk_submit, pipeline_minilm, pipeline_single_calls, processes
from bench.stack import services


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smaller figures (about 3 minutes)")
    p.add_argument("--sections", default="1,2,3", help="which figures to run, e.g. 1,3")
    p.add_argument("--redis-url", help="an existing Redis (default: a redis-server of the bench's own)")
    p.add_argument("--redis-db", type=int, default=14, help="flushed before and after")
    p.add_argument("--postgres-url", help="an existing PostgreSQL (default: a server of the bench's own)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--timeout-s", type=float, default=240, help="give up on one measured phase after this")
    p.add_argument("--py-spy", type=Path, default=None, metavar="DIR", help="sample each worker with py-spy")
    p.add_argument("--py-spy-gil", action="store_true", help="with --py-spy: only samples holding the GIL")
    p.add_argument(
        "--worker-setting",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="extra BATCHWORK_NAME=VALUE for every batchwork worker, e.g. MAX_HELD_ITEMS=400000 (repeatable)",
    )
    p.add_argument(
        "--profile-producer",
        action="store_true",
        help="cProfile batchwork's producer: the delay calls of figure 2 (end to end), submit of figure 3",
    )
    pipeline_minilm.add_arguments(p)
    pipeline_single_calls.add_arguments(p)
    pipeline_bulk_submit.add_arguments(p)
    args = p.parse_args(argv)
    pipeline_minilm.fill_defaults(args)
    pipeline_single_calls.fill_defaults(args)
    pipeline_bulk_submit.fill_defaults(args)
    args.sections = {int(s) for s in args.sections.split(",") if s.strip()}
    return args


def _busy_cores() -> float:
    before = processes.machine_busy_s()
    time.sleep(1)
    return processes.machine_busy_s() - before


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)

    def on_term(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    print(f"bench.pipeline {' '.join(sys.argv[1:]) or '(defaults)'}")
    print("knobs: " + ", ".join(f"{k}={v}" for k, v in sorted(vars(args).items())))
    print(f"machine busy before start: {_busy_cores():.2f} of {os.cpu_count()} cores (1 s sample)")
    print(
        f"host: {os.cpu_count()} cpus, Python {platform.python_version()}, "
        f"{time.strftime('%Y-%m-%d %H:%M:%S')}"
    )
    began = time.monotonic()
    try:
        with services(args) as found:
            print(f"services: Redis db {found.redis_db}, PostgreSQL schema {found.schema}")
            if 1 in args.sections:
                pipeline_minilm.run(args, found)
            if 2 in args.sections:
                pipeline_single_calls.run(args, found)
            if 3 in args.sections:
                pipeline_bulk_submit.run(args, found)
    except KeyboardInterrupt:
        print("\ninterrupted; workers stopped, Redis database flushed, schema dropped", file=sys.stderr)
        raise SystemExit(130) from None
    print(f"\nbench finished in {time.monotonic() - began:.0f} s")


if __name__ == "__main__":
    main()
