"""End-to-end figures on servers of the bench's own, each a ratio measured in one run (bench/README.md,
"bench.pipeline figures"): 1. MiniLM in a plain loop vs submit -> worker -> SQL; 2. noop single-item calls,
batchwork vs plain Celery vs celery-batches (baselines.py); 3. one large noop submit, and where its time goes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy import text

from bench import harness as h

ITEM = "item {}: the quick brown fox jumps over the lazy dog"
RAW, SORTED, PIPELINE = "raw", "raw sorted", "pipeline"
SYSTEMS = ("batchwork", "plain", "celery-batches")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = h.arguments(__doc__, quick="smaller figures (about 2 minutes)", seed=7, services=True, timeout_s=240)
    p.add_argument("--sections", default="1,2,3", help="which figures to run, e.g. 1,3")
    p.add_argument("--minilm-n", type=int, default=64, help="1: raw batch size and max_batch_size")
    p.add_argument("--minilm-items", type=int, default=None, help="1: corpus size (default 2000, quick 600)")
    p.add_argument("--minilm-reps", type=int, default=None, help="1: alternations (default 2, quick 1)")
    p.add_argument("--calls", type=int, default=None, help="2: single-item calls (default 5000, quick 2000)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="2: which ones (the ratios need all three)")
    p.add_argument("--submit-items", type=int, default=None, help="3: default 200000, quick 50000")
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


def cores(cpu: h.CpuMeter, *keys: str) -> list[str]:
    return [f"{cpu.cores[key]:.2f}" for key in keys or ("bench", "workers", "others")]


def wait_job(job_id: str, timeout_s: float) -> Any:
    from worker.client import default_client

    return default_client().wait(job_id, timeout_s, poll_s=h.POLL_S)  # a phase's end seen within 20 ms


def batch_stats(found: h.Stack) -> tuple[int, float, float, float]:
    """Batches stored so far: count, mean size, total run_ms, padded/real tokens."""
    query = "SELECT count(*), avg(size), sum(run_ms), sum(padded_tokens)::float / nullif(sum(real_tokens), 0)"
    with found.db.connect() as conn:
        count, size, run_ms, padding = conn.execute(text(query + " FROM batches")).one()
    return count, float(size or 0), float(run_ms or 0), float(padding or float("nan"))


# -- 1. MiniLM raw vs pipeline --------------------------------------------------------------------------


def minilm(args: argparse.Namespace, found: h.Stack) -> None:
    import torch

    from worker.client import submit
    from worker.models.device import resolve_device
    from worker.models.minilm import MiniLM
    from worker.settings import Settings

    n, texts = args.minilm_n, h.corpus(args.minilm_items, args.seed)
    print(f"\n== 1. MiniLM raw vs pipeline: {len(texts)} sentences of 5-40 words (seed {args.seed}), N={n}, "
          f"max_wait_ms=50, reps={args.minilm_reps}, torch threads={torch.get_num_threads()}")  # fmt: skip
    model = MiniLM(Settings())
    model.load(resolve_device("auto"))
    # raw: batches of N in corpus order; raw sorted: sorted by token count, the least padding a loop can have.
    lengths = {text: prepared.length for text, prepared in zip(texts, model.prepare(texts), strict=True)}
    ordered = sorted(texts, key=lengths.__getitem__)
    batches = {kind: [some[i : i + n] for i in range(0, len(some), n)] for kind, some in
               ((RAW, texts), (SORTED, ordered))}  # fmt: skip
    knobs = {"minilm": {"max_batch_size": n, "max_wait_ms": 50}}
    worker = h.worker(found, "minilm", extra=args.worker_setting, batching=knobs, preload=["minilm"])
    worker.wait_ready()
    wait_job(submit("minilm", texts[: 4 * n]), args.timeout_s)  # warm-up: first shapes allocate
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
    h.print_table(["run", "items/s", "prepare s", "forward s", "batches", "mean N", "padded/real",
                   "model busy", "CPU bench", "CPU worker", "CPU others", "items/CPU s"], table)  # fmt: skip
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


def _minilm_raw(model: Any, batches: list[list[str]], worker: h.Process) -> tuple[float, list[object], float]:
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
    args: argparse.Namespace, found: h.Stack, texts: list[str], worker: h.Process
) -> tuple[float, list[object], float]:
    from worker.client import submit

    found.truncate()
    with h.CpuMeter(worker) as cpu:
        started = time.time()
        job = wait_job(submit("minilm", texts), args.timeout_s)
    elapsed = h.epoch(job.finished_at) - started
    count, size, run_ms, padding = batch_stats(found)
    cells = ["", f"{run_ms / 1000:.2f}", count, f"{size:.1f}", f"{padding:.2f}",
             f"{run_ms / 1000 / elapsed:.0%}", *cores(cpu)]  # fmt: skip
    return job.done / elapsed, cells, cpu.seconds["workers"]


# -- 2. many single-item calls --------------------------------------------------------------------------


def single_calls(args: argparse.Namespace, found: h.Stack) -> None:
    from bench import baselines as b
    from worker.tasks import infer

    items = [ITEM.format(i) for i in range(args.calls)]
    print(f"\n== 2. noop, {len(items)} single-item calls, each system alone on the same Redis and PostgreSQL")
    print(f"  plain: one task and one INSERT per item; celery -P prefork -c 2 --prefetch-multiplier 4; "
          f"celery-batches: flush_every={b.FLUSH_EVERY} flush_interval={b.FLUSH_INTERVAL_S:g} s, one INSERT "
          "per flush, -P solo --prefetch-multiplier 1024; both acks_late, JSON")  # fmt: skip

    def celery(name: str, queue: str, *options: str) -> h.Process:
        argv = h.python("celery", "-A", "bench.baselines", "worker", "-Q", queue, "--loglevel=INFO",
                        "--hostname", f"{name}@bench", "--without-mingle", "--without-gossip",
                        "--without-heartbeat", *options)  # fmt: skip
        return h.start(argv, found.env(), name, h.CELERY_READY)

    systems: dict[str, tuple[str, Callable[[], h.Process], Callable[[int, str], object]]] = {
        "batchwork": ("results", lambda: h.worker(found, "noop-calls", extra=args.worker_setting),
                      lambda i, item: infer.delay(model="noop", inputs=[item])),
        "plain": ("bench_results", lambda: celery("plain", b.PLAIN_QUEUE, "-P", "prefork", "-c", "2",
                                                  "--prefetch-multiplier", "4"), b.plain_store.delay),
        "celery-batches": ("bench_results", lambda: celery("batches", b.BATCHES_QUEUE, "-P", "solo",
                                                           "--prefetch-multiplier", "1024"),
                           b.batches_store.delay),
    }  # fmt: skip
    table: list[list[object]] = []
    rates: dict[str, dict[str, float]] = {"drain": {}, "end-to-end": {}}
    workers: list[h.Process] = []

    def publish_all(publish: Callable[[int, str], object]) -> tuple[float, float]:
        began = time.time()
        for i, item in enumerate(items):
            publish(i, item)
        return began, len(items) / (time.time() - began)

    for name in [s for s in SYSTEMS if s in args.systems.split(",")]:
        table_name, start, publish = systems[name]
        # Drain: everything published with no worker, timed from the worker's ready line to the last row.
        found.truncate("results", "jobs", "batches", "bench_results")
        _, publish_rate = publish_all(publish)
        workers.append(worker := start())
        try:
            ready = worker.wait_ready()
            with h.CpuMeter(worker) as cpu:
                rows = h.wait_rows(found, table_name, len(items), args.timeout_s)
            rates["drain"][name] = _calls_row(table, found, (name, "drain"), publish_rate, rows, ready, cpu)
            # End to end: the worker running, from the first publish to the last row written.
            found.truncate("results", "jobs", "batches", "bench_results")
            with h.CpuMeter(worker) as cpu:
                began, publish_rate = publish_all(publish)
                rows = h.wait_rows(found, table_name, len(items), args.timeout_s)
            rates["end-to-end"][name] = _calls_row(table, found, (name, "end-to-end"), publish_rate, rows,
                                                   began, cpu)  # fmt: skip
        finally:
            worker.stop()
    h.print_table(["system", "phase", "publish items/s", "items/s", "items/s first->last write", "wall s",
                   "batches (mean size)", "CPU bench", "CPU worker", "CPU postgres", "CPU redis",
                   "CPU others"], table)  # fmt: skip
    if set(SYSTEMS) <= rates["drain"].keys():
        e2e, drain = rates["end-to-end"], rates["drain"]
        h.print_table(["ratio", "end-to-end", "drain (pre-filled queue)", "target"], [
            [f"batchwork / {other}", h.ratio(e2e["batchwork"], e2e[other]),
             h.ratio(drain["batchwork"], drain[other]),
             "end-to-end >= 3x, drain >= 5x" if other == "celery-batches" else ""] for other in SYSTEMS[:0:-1]
        ])  # fmt: skip
    h.print_problems(workers)


def _calls_row(table: list[list[object]], found: h.Stack, row: tuple[str, str], publish_rate: float,
               rows: h.Rows, began: float, cpu: h.CpuMeter) -> float:  # fmt: skip
    """A phase's row (system, phase); its items/s (returned) run from ``began`` to the last row written."""
    wall_s = rows.last - began
    count, size, _, _ = batch_stats(found) if row[0] == "batchwork" else (0, 0.0, 0, 0)
    batches = f"{count} ({size:.1f})" if count else ""
    cells = [publish_rate, rows.count / wall_s, rows.commit_rate, f"{wall_s:.2f}", batches]
    table.append([*row, *cells, *cores(cpu, "bench", "workers", "postgres", "redis", "rest")])
    return rows.count / wall_s


# -- 3. one large submit --------------------------------------------------------------------------------


def bulk_submit(args: argparse.Namespace, found: h.Stack) -> None:
    from worker.client import Client, submit
    from worker.jobs import Jobs
    from worker.settings import get_settings

    total, settings = args.submit_items, get_settings()
    print(f"\n== 3. noop, one submit of {total:,} items (submit_chunk_size={settings.submit_chunk_size}, "
          f"noop N=model default, prefetch_count={settings.prefetch_count})")  # fmt: skip
    inputs = [ITEM.format(i) for i in range(total)]
    worker = h.worker(found, "noop-submit", extra=args.worker_setting)
    # submit()'s steps, timed apart: Client.check, then the jobs port's record (SQL row) and publish.
    parts = {"check": Client, "record": Jobs, "publish": Jobs}
    originals = {name: getattr(owner, name) for name, owner in parts.items()}
    seconds = dict.fromkeys(parts, 0.0)

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
        wait_job(submit("noop", inputs[:2000]), args.timeout_s)  # warm-up: connections, first batches
        found.truncate()
        for name, function in originals.items():
            setattr(parts[name], name, timed(name, function))
        with h.CpuMeter(worker) as cpu:
            started = time.time()
            job_id = submit("noop", inputs)
            submitted = time.time()
            job = wait_job(job_id, args.timeout_s)
    finally:
        for name, function in originals.items():
            setattr(parts[name], name, function)
        worker.stop()
    finished = h.epoch(job.finished_at)
    count, size, run_ms, _ = batch_stats(found)
    with found.db.connect() as conn:
        first_batch = h.epoch(conn.execute(text("SELECT min(started_at) FROM batches")).scalar_one())
    submit_s = submitted - started
    seconds["other (chunking, producer)"] = submit_s - sum(seconds.values())
    h.print_table(["in submit()", "s", "share"], [[name, f"{s:.3f}", f"{s / submit_s:.0%}"] for name, s in
                  (*seconds.items(), ("submit total", submit_s))])  # fmt: skip
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
    print(f"  end to end {job.done / e2e_s:,.0f} items/s (target >= 150,000); worker CPU "
          f"{cpu.seconds['workers'] / max(1, job.done) * 1e6:.1f} µs per item (target <= 5)")  # fmt: skip
    print("  CPU µs per item: " + ", ".join(f"{name} {seconds / max(1, job.done) * 1e6:.1f}"
                                           for name, seconds in cpu.seconds.items()))  # fmt: skip
    h.print_problems([worker])


if __name__ == "__main__":
    main()
