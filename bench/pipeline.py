"""End-to-end throughput of batchwork on a Redis and PostgreSQL of the bench's own, each figure a ratio
measured in one run (bench/README.md, "bench.pipeline figures"):

1. MiniLM: the model in a plain loop (raw, raw sorted) vs the same corpus through submit -> worker -> SQL.
2. noop, many single-item calls: batchwork ``infer.delay`` vs plain Celery vs celery-batches (baselines.py).
3. noop, one large ``submit``: items/s, and the time inside submit vs the worker's drain.

Prints tables, never asserts. ``python -m bench.pipeline [--quick] [--sections 1,3]``.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy import text

from bench import harness as h

ITEM = "item {}: the quick brown fox jumps over the lazy dog"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = h.arguments(__doc__, quick="smaller figures (about 2 minutes)", seed=7, services=True, timeout_s=240)
    p.add_argument("--sections", default="1,2,3", help="which figures to run, e.g. 1,3")
    g = p.add_argument_group("figure 1: MiniLM")
    g.add_argument("--minilm-n", type=int, default=64, help="N, raw batch size and max_batch_size")
    g.add_argument("--minilm-wait-ms", type=float, default=50)
    g.add_argument("--minilm-items", type=int, default=None, help="corpus size (default 2000, quick 600)")
    g.add_argument("--minilm-reps", type=int, default=None, help="alternations (default 2, quick 1)")
    g = p.add_argument_group("figure 2: noop, many single-item calls")
    g.add_argument("--calls", type=int, default=None, help="items, one call each (default 5000, quick 2000)")
    g.add_argument("--systems", default="batchwork,plain,celery-batches",
                   help="which systems to run (the ratios need all three)")  # fmt: skip
    g.add_argument("--plain-pool", default="prefork", choices=["prefork", "solo", "threads"])
    g.add_argument("--plain-concurrency", type=int, default=2)
    g.add_argument("--plain-prefetch", type=int, default=4, help="worker_prefetch_multiplier")
    g.add_argument("--flush-every", type=int, default=256, help="celery-batches flush_every")
    g.add_argument("--flush-interval-s", type=float, default=0.05, help="celery-batches flush_interval")
    g.add_argument("--batches-prefetch", type=int, default=1024, help="celery-batches prefetch multiplier")
    g = p.add_argument_group("figure 3: noop, one large submit")
    g.add_argument("--submit-items", type=int, default=None, help="default 200000, quick 50000")
    g.add_argument("--noop-n", type=int, default=None, help="noop max_batch_size (default: the model's)")
    args = p.parse_args(argv)
    args.minilm_items = args.minilm_items or (600 if args.quick else 2000)
    args.minilm_reps = args.minilm_reps or (1 if args.quick else 2)
    args.calls = args.calls or (2000 if args.quick else 5000)
    args.submit_items = args.submit_items or (50_000 if args.quick else 200_000)
    args.sections = {int(s) for s in args.sections.split(",") if s.strip()}
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    h.header("bench.pipeline", args)
    began = time.monotonic()
    try:
        with h.stack() as found:
            from bench.baselines import metadata

            metadata.create_all(found.db)
            for number, figure in ((1, minilm), (2, single_calls), (3, bulk_submit)):
                if number in args.sections:
                    figure(args, found)
                    found.truncate("results", "jobs", "batches", "bench_results")
    except KeyboardInterrupt:
        print("\ninterrupted; workers and servers stopped", file=sys.stderr)
        raise SystemExit(130) from None
    print(f"\nbench finished in {time.monotonic() - began:.0f} s")


def cores(cpu: h.CpuMeter) -> list[str]:
    return [f"{cpu.cores[key]:.2f}" for key in ("bench", "workers", "others")]


# -- 1. MiniLM raw vs pipeline --------------------------------------------------------------------------

RAW, SORTED, PIPELINE = "raw", "raw sorted", "pipeline"


def minilm(args: argparse.Namespace, found: h.Stack) -> None:
    import torch

    from worker.client import submit
    from worker.models.device import resolve_device
    from worker.models.minilm import MiniLM
    from worker.settings import Settings

    n, texts = args.minilm_n, h.corpus(args.minilm_items, args.seed)
    print(f"\n== 1. MiniLM raw vs pipeline: {len(texts)} sentences of 5-40 words (seed {args.seed}), N={n}, "
          f"max_wait_ms={args.minilm_wait_ms:g}, reps={args.minilm_reps}, "
          f"torch threads={torch.get_num_threads()}")  # fmt: skip
    model = MiniLM(Settings())
    model.load(resolve_device("auto"))
    # raw: batches of N in corpus order; raw sorted: sorted by token count, the least padding a loop can have.
    lengths = {text: prepared.length for text, prepared in zip(texts, model.prepare(texts), strict=True)}
    ordered = sorted(texts, key=lengths.__getitem__)
    batches = {RAW: [texts[i : i + n] for i in range(0, len(texts), n)],
               SORTED: [ordered[i : i + n] for i in range(0, len(ordered), n)]}  # fmt: skip
    knobs = {"minilm": {"max_batch_size": n, "max_wait_ms": args.minilm_wait_ms}}
    worker = h.worker(found, "minilm", extra=args.worker_setting, batching=knobs, preload=["minilm"])
    worker.wait_ready()
    h.wait_job(submit("minilm", texts[: 4 * n]), args.timeout_s)  # warm-up: first shapes allocate
    for batch in batches[RAW][:4]:
        model.forward([prepared.payload for prepared in model.prepare(batch)])
    table: list[list[object]] = []
    rates: dict[str, list[float]] = {RAW: [], SORTED: [], PIPELINE: []}
    per_cpu: dict[str, list[float]] = {RAW: [], SORTED: [], PIPELINE: []}
    for rep in range(args.minilm_reps):
        for kind in (RAW, SORTED, PIPELINE) if rep % 2 == 0 else (PIPELINE, SORTED, RAW):  # ABBA
            if kind == PIPELINE:
                rate, cells, cpu_s = _minilm_pipeline(args, found, texts, worker)
            else:
                rate, cells, cpu_s = _minilm_raw(model, batches[kind], worker)
            rates[kind].append(rate)
            per_cpu[kind].append(len(texts) / cpu_s)
            table.append([f"{kind} #{rep + 1}", rate, *cells, len(texts) / cpu_s])
    headers = ["run", "items/s", "prepare s", "forward s", "batches", "mean N", "padded/real", "model busy"]
    h.print_table([*headers, "CPU bench", "CPU worker", "CPU others", "items/CPU s"], table)
    pipe, pipe_cpu = statistics.median(rates[PIPELINE]), statistics.median(per_cpu[PIPELINE])
    rows = []
    for kind in (RAW, SORTED):
        base, base_cpu = statistics.median(rates[kind]), statistics.median(per_cpu[kind])
        pairs = ", ".join(h.ratio(p, r) for p, r in zip(rates[PIPELINE], rates[kind], strict=True))
        rows.append([f"pipeline / {kind}", f"{pipe:,.0f} / {base:,.0f}", h.ratio(pipe, base), pairs,
                     h.ratio(pipe_cpu, base_cpu), ">= 0.90" if kind == RAW else ""])  # fmt: skip
    h.print_table(["medians", "items/s", "ratio", "per rep", "ratio per CPU s", "target"], rows)
    print("  per CPU s: items per CPU second of the bench process (raw) or of the worker (pipeline);")
    print("  forward s of a pipeline run: the worker's sum of batches.run_ms; model busy: that / wall time")
    worker.stop()
    h.print_problems([worker])


def _minilm_raw(model: Any, batches: list[list[str]], worker: h.Proc) -> tuple[float, list[object], float]:
    """prepare + forward in a plain loop, in this process; the worker beside it is idle (about 0.03 cores)."""
    prepare_s = forward_s = 0.0
    real = padded = 0
    with h.CpuMeter(worker) as cpu:
        started = time.perf_counter()
        for batch in batches:
            t0 = time.perf_counter()
            payloads = [prepared.payload for prepared in model.prepare(batch)]
            t1 = time.perf_counter()
            model.forward(payloads)
            prepare_s, forward_s = prepare_s + t1 - t0, forward_s + time.perf_counter() - t1
            real += sum(len(ids) for ids in payloads)
            padded += max(len(ids) for ids in payloads) * len(payloads)
        elapsed = time.perf_counter() - started
    items = sum(len(batch) for batch in batches)
    cells = [f"{prepare_s:.2f}", f"{forward_s:.2f}", len(batches), f"{items / len(batches):.1f}",
             f"{padded / real:.2f}", "", *cores(cpu)]  # fmt: skip
    return items / elapsed, cells, cpu.seconds["bench"]


def _minilm_pipeline(
    args: argparse.Namespace, found: h.Stack, texts: list[str], worker: h.Proc
) -> tuple[float, list[object], float]:
    from worker.client import submit

    found.truncate()
    with h.CpuMeter(worker) as cpu:
        started = time.time()
        job = h.wait_job(submit("minilm", texts), args.timeout_s)
    elapsed = h.epoch(job.finished_at) - started
    count, size, run_ms, padding = h.batch_stats(found)
    cells = ["", f"{run_ms / 1000:.2f}", count, f"{size:.1f}", f"{padding:.2f}",
             f"{run_ms / 1000 / elapsed:.0%}", *cores(cpu)]  # fmt: skip
    return job.done / elapsed, cells, cpu.seconds["workers"]


# -- 2. many single-item calls --------------------------------------------------------------------------


def single_calls(args: argparse.Namespace, found: h.Stack) -> None:
    from bench.baselines import BATCHES_QUEUE, PLAIN_QUEUE, batches_store, plain_store
    from worker.tasks import infer

    items = [ITEM.format(i) for i in range(args.calls)]
    print(f"\n== 2. noop, {len(items)} single-item calls, each system alone on the same Redis and PostgreSQL")
    print(f"  plain: one task and one INSERT per item; celery -P {args.plain_pool} "
          f"-c {args.plain_concurrency} "
          f"--prefetch-multiplier {args.plain_prefetch}; celery-batches: flush_every={args.flush_every} "
          f"flush_interval={args.flush_interval_s:g} s, one INSERT per flush, -P solo "
          f"--prefetch-multiplier {args.batches_prefetch}; both acks_late, JSON")  # fmt: skip

    def celery(name: str, queue: str, *options: str, **env: str) -> h.Proc:
        argv = h.python("celery", "-A", "bench.baselines", "worker", "-Q", queue, "--loglevel=INFO",
                        "--hostname", f"{name}@bench", "--without-mingle", "--without-gossip",
                        "--without-heartbeat", *options)  # fmt: skip
        return h.Proc(argv, found.env(**env), name, h.CELERY_READY)

    systems: list[tuple[str, str, Callable[[], h.Proc], Callable[[int, str], object]]] = [
        ("batchwork", "results", lambda: h.worker(found, "noop-calls", extra=args.worker_setting),
         lambda i, item: infer.delay(model="noop", inputs=[item])),
        ("plain", "bench_results",
         lambda: celery("plain", PLAIN_QUEUE, "-P", args.plain_pool, "-c", str(args.plain_concurrency),
                        "--prefetch-multiplier", str(args.plain_prefetch)),
         lambda i, item: plain_store.delay(i, item)),
        ("celery-batches", "bench_results",
         lambda: celery("batches", BATCHES_QUEUE, "-P", "solo", "--prefetch-multiplier",
                        str(args.batches_prefetch), BENCH_FLUSH_EVERY=str(args.flush_every),
                        BENCH_FLUSH_INTERVAL_S=str(args.flush_interval_s)),
         lambda i, item: batches_store.delay(i, item)),
    ]  # fmt: skip
    chosen = set(args.systems.split(","))
    systems = [system for system in systems if system[0] in chosen]
    table: list[list[object]] = []
    e2e: dict[str, float] = {}
    drain: dict[str, float] = {}
    workers: list[h.Proc] = []
    for name, table_name, start, publish in systems:
        # Drain: everything published with no worker, timed from the worker's ready line to the last row.
        found.truncate("results", "jobs", "batches", "bench_results")
        began = time.time()
        for i, item in enumerate(items):
            publish(i, item)
        publish_rate = len(items) / (time.time() - began)
        worker = start()
        workers.append(worker)
        try:
            ready = worker.wait_ready()
            with h.CpuMeter(worker) as cpu:
                rows = h.wait_rows(found, table_name, len(items), args.timeout_s)
            drain[name] = _calls_row(table, found, name, "drain", publish_rate, rows, ready, cpu)
            # End to end: the worker running, from the first publish to the last row written.
            found.truncate("results", "jobs", "batches", "bench_results")
            with h.CpuMeter(worker) as cpu:
                began = time.time()
                for i, item in enumerate(items):
                    publish(i, item)
                publish_rate = len(items) / (time.time() - began)
                rows = h.wait_rows(found, table_name, len(items), args.timeout_s)
            e2e[name] = _calls_row(table, found, name, "end-to-end", publish_rate, rows, began, cpu)
        finally:
            worker.stop()
    h.print_table(["system", "phase", "publish items/s", "items/s", "items/s first->last write", "wall s",
                   "batches (mean size)", "CPU bench", "CPU worker", "CPU postgres", "CPU redis",
                   "CPU others"], table)  # fmt: skip
    if {"batchwork", "plain", "celery-batches"} <= e2e.keys():
        h.print_table(["ratio", "end-to-end", "drain (pre-filled queue)", "target"], [
            ["batchwork / celery-batches", h.ratio(e2e["batchwork"], e2e["celery-batches"]),
             h.ratio(drain["batchwork"], drain["celery-batches"]), "end-to-end >= 3x, drain >= 5x"],
            ["batchwork / plain", h.ratio(e2e["batchwork"], e2e["plain"]),
             h.ratio(drain["batchwork"], drain["plain"]), ""],
        ])  # fmt: skip
    h.print_problems(workers)


def _calls_row(table: list[list[object]], found: h.Stack, name: str, phase: str, publish_rate: float,
               rows: h.Rows, began: float, cpu: h.CpuMeter) -> float:  # fmt: skip
    """A phase's row; its items/s (returned) run from ``began`` to the last row written."""
    wall_s = rows.last - began
    batches = ""
    if name == "batchwork":
        count, size, _, _ = h.batch_stats(found)
        batches = f"{count} ({size:.1f})"
    cells = [publish_rate, rows.count / wall_s, rows.commit_rate, f"{wall_s:.2f}", batches]
    servers = [f"{cpu.cores[key]:.2f}" for key in ("postgres", "redis")]
    table.append([name, phase, *cells, *cores(cpu)[:2], *servers, f"{cpu.cores['rest']:.2f}"])
    return rows.count / wall_s


# -- 3. one large submit --------------------------------------------------------------------------------

# Client.submit's steps, timed apart: its check, then the jobs port's record and publish.
SUBMIT_PARTS = {"check": "worker.client:Client", "record": "worker.jobs:Jobs", "publish": "worker.jobs:Jobs"}


def _class(where: str) -> Any:
    module, name = where.split(":")
    return getattr(importlib.import_module(module), name)


def bulk_submit(args: argparse.Namespace, found: h.Stack) -> None:
    from worker.client import submit
    from worker.settings import get_settings

    total, settings = args.submit_items, get_settings()
    knobs = {"noop": {"max_batch_size": args.noop_n}} if args.noop_n else {}
    print(f"\n== 3. noop, one submit of {total:,} items (submit_chunk_size={settings.submit_chunk_size}, "
          f"noop N={args.noop_n or 'model default'}, prefetch_count={settings.prefetch_count})")  # fmt: skip
    inputs = [ITEM.format(i) for i in range(total)]
    worker = h.worker(found, "noop-submit", extra=args.worker_setting, batching=knobs)
    seconds = dict.fromkeys(SUBMIT_PARTS, 0.0)
    owners = {name: _class(where) for name, where in SUBMIT_PARTS.items()}
    originals = {name: getattr(owners[name], name) for name in SUBMIT_PARTS}

    def timed(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*a: Any, **kw: Any) -> Any:
            started = time.perf_counter()
            try:
                return function(*a, **kw)
            finally:
                seconds[name] += time.perf_counter() - started

        return wrapper

    try:
        worker.wait_ready()
        h.wait_job(submit("noop", inputs[:2000]), args.timeout_s)  # warm-up: connections, first batches
        found.truncate()
        for name, function in originals.items():
            setattr(owners[name], name, timed(name, function))
        with h.CpuMeter(worker) as cpu:
            started = time.time()
            job_id = submit("noop", inputs)
            submitted = time.time()
            job = h.wait_job(job_id, args.timeout_s)
    finally:
        for name, function in originals.items():
            setattr(owners[name], name, function)
        worker.stop()
    finished = h.epoch(job.finished_at)
    count, size, run_ms, _ = h.batch_stats(found)
    with found.db.connect() as conn:
        first_batch = h.epoch(conn.execute(text("SELECT min(started_at) FROM batches")).scalar_one())
    submit_s = submitted - started
    other = submit_s - sum(seconds.values())
    h.print_table(["in submit()", "s", "share"],
                  [[name, f"{s:.3f}", f"{s / submit_s:.0%}"] for name, s in seconds.items()]
                  + [["other (chunking, producer)", f"{other:.3f}", f"{other / submit_s:.0%}"],
                     ["submit total", f"{submit_s:.3f}", "100%"]])  # fmt: skip
    drain_s, e2e_s = finished - first_batch, finished - started
    h.print_table(["phase", "s", "items/s"], [
        ["submit() call", f"{submit_s:.2f}", total / submit_s],
        ["after submit returned, until finished", f"{finished - submitted:.2f}", ""],
        ["worker: first batch start -> finished", f"{drain_s:.2f}", job.done / drain_s],
        ["end to end: submit call -> succeeded", f"{e2e_s:.2f}", job.done / e2e_s],
    ])  # fmt: skip
    print(f"  job {job.state}: {job.done} done, {job.failed} failed; {count} batches, mean size {size:.0f}, "
          f"model run {run_ms / 1000:.2f} s in all; CPU (cores) "
          + ", ".join(f"{name} {cores:.2f}" for name, cores in cpu.cores.items()))  # fmt: skip
    print(f"  end to end {job.done / (finished - started):,.0f} items/s (target >= 150,000); worker CPU "
          f"{cpu.seconds['workers'] / max(1, job.done) * 1e6:.1f} µs per item (target <= 5)")  # fmt: skip
    print("  CPU µs per item: " + ", ".join(f"{name} {seconds / max(1, job.done) * 1e6:.1f}"
                                           for name, seconds in cpu.seconds.items()))  # fmt: skip
    h.print_problems([worker])


if __name__ == "__main__":
    main()
