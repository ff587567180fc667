"""The pure scheduler's cost with many jobs held: 50,000 single-item jobs in one lane, then batches taken
until it drains. Prints µs per item added and ms per batch taken (the lock the intake also needs is held
that long). No services; run it on two checkouts to compare.

    python -m bench.scheduler_load [--jobs 50000] [--batch 64]
"""

from __future__ import annotations

import argparse
import time

from worker.batching.policy import LanePolicy
from worker.batching.scheduler import Item, Scheduler


def measure(jobs: int, batch: int) -> tuple[float, float, int]:
    policy = LanePolicy(
        max_batch_size=batch,
        max_wait_s=0.05,
        rank=1,
        max_batch_tokens=4096,
        bucket_edges=(8, 16, 32, 64, 128),
    )
    scheduler = Scheduler(lambda lane: policy)
    started = time.perf_counter()
    for i in range(jobs):  # lengths 5..104, arrivals 10 µs apart: every job its own
        scheduler.add("m", "normal", Item(f"job-{i}", 0, 5 + (i * 7) % 100, i * 1e-5))
    added_s = time.perf_counter() - started
    started, batches = time.perf_counter(), 0
    while scheduler.next_batch(now=10.0) is not None:
        batches += 1
    return added_s / jobs * 1e6, (time.perf_counter() - started) / batches * 1e3, batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=50_000)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    for jobs in (args.jobs // 10, args.jobs):
        per_item_us, per_batch_ms, batches = measure(jobs, args.batch)
        print(f"{jobs:>7} jobs held: add {per_item_us:.1f} µs/item, take {per_batch_ms:.2f} ms/batch", end="")
        print(f" ({batches} batches)")


if __name__ == "__main__":
    main()
