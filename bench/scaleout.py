"""Scale-out: 1, 2 and 4 batchwork workers on one Redis + PostgreSQL, fed single-item calls by producer
processes, then one bulk ``submit``: items/s, item latency (result row less job creation, queueing included,
at saturation) and who used the CPU. The ``simulated`` model's batch sleeps a + b*n ms, as a GPU would.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from collections.abc import Callable, Sequence

from sqlalchemy import text

from bench import harness as h


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = h.arguments(__doc__, quick="fewer items (about 2 minutes)", services=True)
    p.add_argument("--workers", default="1,2,4", help="worker counts to measure")
    p.add_argument("--producers", type=int, default=4, help="producer processes for the single-item calls")
    p.add_argument("--calls", type=int, default=None, help="single-item calls (default 4000, quick 2000)")
    p.add_argument(
        "--submit-items", type=int, default=None, help="one bulk submit (default 12000, quick 6000)"
    )
    p.add_argument("--base-ms", type=float, default=200.0, help="simulated batch cost a in a + b*n")
    p.add_argument("--per-item-ms", type=float, default=4.0, help="simulated batch cost b in a + b*n")
    p.add_argument("--n", type=int, default=64, help="max_batch_size of every worker")
    p.add_argument("--produce", nargs=2, type=float, help=argparse.SUPPRESS)  # a producer: COUNT START_AT
    args = p.parse_args(argv)
    args.calls = args.calls or (2000 if args.quick else 4000)
    args.submit_items = args.submit_items or (6000 if args.quick else 12000)
    args.counts = [int(c) for c in args.workers.split(",") if c.strip()]
    return args


def produce(count: float, start_at: float) -> None:
    """A producer subprocess: ``count`` single-item ``infer.delay`` calls as fast as it can, from
    ``start_at`` (so every producer starts together); prints its first and last send times as JSON."""
    from worker.tasks import infer

    infer.delay(model="simulated", inputs=["warm-up"])  # connects; the bench subtracts this job
    time.sleep(max(0.0, start_at - time.time()))
    first, cpu = time.time(), time.process_time()
    for i in range(int(count)):
        infer.delay(model="simulated", inputs=[f"call {i} from {os.getpid()}"])
    print(json.dumps({"first": first, "last": time.time(), "cpu_s": time.process_time() - cpu}), flush=True)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.produce is not None:
        return produce(*args.produce)
    h.header("bench.scaleout", args)
    ceiling = args.n / (args.base_ms + args.per_item_ms * args.n) * 1000
    print(f"simulated model: {args.base_ms:g} ms + {args.per_item_ms:g} ms/item per batch, N={args.n}: "
          f"one worker's ceiling {ceiling:.0f} items/s; {args.producers} producers, "
          f"{args.calls} calls")  # fmt: skip
    with h.stack() as found:
        calls, bulk = {}, {}
        for count in args.counts:
            calls[count] = measure(args, found, count, single_item_calls)
            bulk[count] = measure(args, found, count, bulk_submit)
    one = args.counts[0]
    print("\n== single-item calls")
    columns = ["p50 ms", "p99 ms", "publish items/s", "producer CPU us/call"]
    cpus = ["cpu workers", "cpu redis", "cpu postgres", "cpu others"]
    h.print_table(["workers", "items/s", "vs 1 worker", *columns, *cpus],
                  [[count, f"{c['items/s']:.0f}", h.ratio(c["items/s"], calls[one]["items/s"]),
                    *(f"{c[k]:.0f}" for k in columns), *(f"{c[k]:.2f}" for k in cpus)]
                   for count, c in calls.items()])  # fmt: skip
    print("  target: 4 workers >= 3.3x one worker\n\n== one bulk submit")
    h.print_table(["workers", "items/s", "vs 1 worker", "submit s"],
                  [[count, f"{b['items/s']:.0f}", h.ratio(b["items/s"], bulk[one]["items/s"]),
                    f"{b['submit s']:.1f}"] for count, b in bulk.items()])  # fmt: skip


def measure(
    args: argparse.Namespace, found: h.Stack, count: int, how: Callable[..., dict]
) -> dict[str, float]:
    """``how(args, found, meter)`` with ``count`` fresh workers on an empty store; CPU cores of the workers,
    Redis, PostgreSQL and everything else (producers, this bench) added to its figures."""
    found.truncate()
    knobs = {"simulated": {"max_batch_size": args.n, "max_wait_ms": 20}}
    simulated = {"simulated_base_ms": args.base_ms, "simulated_per_item_ms": args.per_item_ms}
    workers = [h.worker(found, f"scale{count}-{i}", extra=args.worker_setting, batching=knobs, **simulated)
               for i in range(count)]  # fmt: skip
    for worker in workers:
        worker.wait_ready()
    meter = h.CpuMeter(*workers)
    figures = how(args, found, meter)
    for worker in workers:
        worker.stop()
    cores = {k: meter.cores[k] for k in ("workers", "redis", "postgres")}
    cores["others"] = meter.cores["rest"] + meter.cores["bench"]
    print(f"  {count} worker(s), {how.__name__}: {figures.pop('said')}; CPU cores used: "
          + ", ".join(f"{k} {v:.2f}" for k, v in cores.items()))  # fmt: skip
    return figures | {f"cpu {k}": v for k, v in cores.items()}


def single_item_calls(args: argparse.Namespace, found: h.Stack, meter: h.CpuMeter) -> dict:
    per_producer = args.calls // args.producers
    total = per_producer * args.producers
    start_at = time.time() + 3.0  # every producer has imported batchwork and connected by then
    argv = h.python("bench.scaleout", "--produce", str(per_producer), repr(start_at))
    producers = [subprocess.Popen(argv, cwd=h.ROOT, env=found.env(), stdout=subprocess.PIPE, text=True)
                 for _ in range(args.producers)]  # fmt: skip
    time.sleep(max(0.0, start_at - time.time()))
    with meter:
        stored = h.wait_rows(found, "results", total + args.producers, args.timeout_s)
    sent = [json.loads(p.communicate(timeout=60)[0].strip().splitlines()[-1]) for p in producers]
    first_sent = min(s["first"] for s in sent)
    wall = stored.last - first_sent
    # An item's latency: its result row's write time less its job's creation time (queueing included).
    query = text("SELECT percentile_cont(ARRAY[0.5, 0.99]) WITHIN GROUP (ORDER BY extract(epoch FROM "
                 "r.created_at - j.created_at)) FROM results r JOIN jobs j ON j.id = r.job_id "
                 "WHERE j.created_at >= to_timestamp(:since)")  # fmt: skip
    with found.db.connect() as conn:
        p50, p99 = conn.execute(query, {"since": first_sent}).scalar_one()
    return {"said": f"{total} items in {wall:.1f} s", "items/s": total / wall, "p50 ms": p50 * 1000,
            "p99 ms": p99 * 1000, "publish items/s": total / (max(s["last"] for s in sent) - first_sent),
            "producer CPU us/call": sum(s["cpu_s"] for s in sent) / total * 1e6}  # fmt: skip


def bulk_submit(args: argparse.Namespace, found: h.Stack, meter: h.CpuMeter) -> dict:
    from worker.client import submit

    inputs = [f"bulk item {i}" for i in range(args.submit_items)]
    with meter:
        began = time.time()
        submit("simulated", inputs, priority="bulk")
        submitted = time.time() - began
        stored = h.wait_rows(found, "results", len(inputs), args.timeout_s)
    wall = stored.last - began
    said = f"{len(inputs)} items in {wall:.1f} s (submit {submitted:.1f} s)"
    return {"said": said, "items/s": len(inputs) / wall, "submit s": submitted}


if __name__ == "__main__":
    main()
