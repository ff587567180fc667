"""End-to-end throughput of batchwork on real Redis + PostgreSQL, each figure a ratio measured in one run.

1. MiniLM: our model in a plain loop (raw) vs the same corpus through submit -> worker -> SQL (pipeline).
2. noop, many single-item calls: batchwork ``infer.delay`` vs plain Celery vs celery-batches.
3. noop, one large ``submit``: items/s, and the time inside submit vs the worker's drain.
Prints tables, never asserts, cleans up its Redis database, PostgreSQL schema and workers. Run from the
repository root: ``python -m bench.pipeline [--quick]``.
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import text

from bench import processes, spy
from bench.processes import WorkerProcess, python_module
from bench.stack import (
    Services,
    batch_stats,
    batchwork_worker,
    cores,
    epoch,
    print_problems,
    print_profile,
    print_table,
    producer_profiler,
    ratio,
    services,
    wait_job,
    wait_rows,
)

# -- set-up ------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smaller figures (about 3 minutes)")
    p.add_argument("--sections", default="1,2,3", help="which figures to run, e.g. 1,3")
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379")
    p.add_argument("--redis-db", type=int, default=14, help="flushed before and after")
    p.add_argument("--postgres-url", default="postgresql+psycopg://root@127.0.0.1:5432/test")
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
    g = p.add_argument_group("figure 1: MiniLM")
    g.add_argument("--minilm-n", type=int, default=64, help="N, raw batch size and max_batch_size")
    g.add_argument("--minilm-wait-ms", type=float, default=50)
    g.add_argument("--minilm-items", type=int, default=None, help="corpus size (default 2000, quick 600)")
    g.add_argument(
        "--minilm-reps", type=int, default=None, help="raw/pipeline alternations (default 2, quick 1)"
    )
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
    g = p.add_argument_group("figure 3: noop, one large submit")
    g.add_argument("--submit-items", type=int, default=None, help="default 200000, quick 50000")
    g.add_argument("--noop-n", type=int, default=None, help="noop max_batch_size (default: the model's own)")
    args = p.parse_args(argv)
    quick = args.quick
    args.minilm_items = args.minilm_items or (600 if quick else 2000)
    args.minilm_reps = args.minilm_reps or (1 if quick else 2)
    args.calls = args.calls or (2000 if quick else 5000)
    args.submit_items = args.submit_items or (50_000 if quick else 200_000)
    args.sections = {int(s) for s in args.sections.split(",") if s.strip()}
    return args


# -- figure 1: MiniLM raw vs pipeline ----------------------------------------------------------


RAW, SORTED, PIPELINE = "raw", "raw sorted", "pipeline"


def minilm_section(args: argparse.Namespace, services: Services) -> None:
    import torch

    from bench.minilm_batch_curve import corpus
    from worker.client import submit
    from worker.models.device import resolve_device
    from worker.models.minilm import MiniLM
    from worker.settings import Settings

    n, texts = args.minilm_n, corpus(args.minilm_items, args.seed)
    print(
        f"\n== 1. MiniLM raw vs pipeline: {len(texts)} sentences of 5-40 words (seed {args.seed}), N={n}, "
        f"max_wait_ms={args.minilm_wait_ms:g}, reps={args.minilm_reps}, "
        f"torch threads={torch.get_num_threads()}"
    )
    model = MiniLM(Settings())
    model.load(resolve_device("auto"))
    # "raw": batches of N in corpus order; "raw sorted": the corpus sorted by token count first, the least
    # padding a plain loop can have (the worker's length buckets aim between the two).
    lengths = {text: prepared.length for text, prepared in zip(texts, model.prepare(texts), strict=True)}
    ordered = sorted(texts, key=lengths.__getitem__)
    batches = {
        RAW: [texts[i : i + n] for i in range(0, len(texts), n)],
        SORTED: [ordered[i : i + n] for i in range(0, len(ordered), n)],
    }
    knobs = {"minilm": {"max_batch_size": n, "max_wait_ms": args.minilm_wait_ms}}
    worker = batchwork_worker(services, "minilm", batching=knobs, preload=["minilm"])
    worker.wait_ready()
    wait_job(submit("minilm", texts[: 4 * n]), args.timeout_s)  # warm-up: first shapes allocate
    for batch in batches[RAW][:4]:
        model.forward([prepared.payload for prepared in model.prepare(batch)])

    table: list[list[object]] = []
    rates: dict[str, list[float]] = {RAW: [], SORTED: [], PIPELINE: []}
    per_cpu: dict[str, list[float]] = {RAW: [], SORTED: [], PIPELINE: []}
    for rep in range(args.minilm_reps):
        # Alternating order (ABBA) cancels a load that drifts steadily during the run.
        for kind in (RAW, SORTED, PIPELINE) if rep % 2 == 0 else (PIPELINE, SORTED, RAW):
            if kind == PIPELINE:
                rate, cells, cpu_s = _minilm_pipeline(
                    args, services, texts, worker, f"minilm-pipeline-{rep + 1}"
                )
            else:
                rate, cells, cpu_s = _minilm_raw(model, batches[kind], worker)
            rates[kind].append(rate)
            per_cpu[kind].append(len(texts) / cpu_s)
            table.append([f"{kind} #{rep + 1}", rate, *cells, len(texts) / cpu_s])
    headers = ["run", "items/s", "prepare s", "forward s", "batches", "mean N", "padded/real", "model busy"]
    print_table([*headers, "CPU bench", "CPU worker", "CPU others", "items/CPU s"], table)
    _minilm_summary(rates, per_cpu)
    worker.stop()
    print_problems([worker])
    services.truncate()


def _minilm_summary(rates: dict[str, list[float]], per_cpu: dict[str, list[float]]) -> None:
    pipe, pipe_cpu = statistics.median(rates[PIPELINE]), statistics.median(per_cpu[PIPELINE])
    rows = []
    for kind in (RAW, SORTED):
        base, base_cpu = statistics.median(rates[kind]), statistics.median(per_cpu[kind])
        pairs = ", ".join(ratio(p, r) for p, r in zip(rates[PIPELINE], rates[kind], strict=True))
        rows.append(
            [
                f"pipeline / {kind}",
                f"{pipe:,.0f} / {base:,.0f}",
                ratio(pipe, base),
                pairs,
                ratio(pipe_cpu, base_cpu),
                ">= 0.90" if kind == RAW else "",
            ]
        )
    print_table(["medians", "items/s", "ratio", "per rep", "ratio per CPU s", "target"], rows)
    print("  per CPU s: items per CPU second of the bench process (raw) or the worker process (pipeline);")
    print("  it moves less than items/s when other users load the machine ('CPU others', in cores).")
    print("  forward s of a pipeline run: the worker's sum of batches.run_ms; model busy: that / wall time")


def _minilm_raw(
    model: Any, batches: list[list[str]], worker: WorkerProcess
) -> tuple[float, list[object], float]:
    """prepare + forward in a plain loop, in this process; the worker beside it is idle (about 0.03 cores)."""
    prepare_s = forward_s = 0.0
    real = padded = 0
    with processes.CpuMeter(worker) as cpu:
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
    size = items / len(batches)
    cells: list[object] = [
        f"{prepare_s:.2f}",
        f"{forward_s:.2f}",
        len(batches),
        f"{size:.1f}",
        f"{padded / real:.2f}",
        "",
        *cores(cpu),
    ]
    return items / elapsed, cells, cpu.seconds["bench"]


def _minilm_pipeline(
    args: argparse.Namespace, services: Services, texts: list[str], worker: WorkerProcess, name: str
) -> tuple[float, list[object], float]:
    from worker.client import submit

    services.truncate()
    with spy.record(worker.pid, args.py_spy, name, args.py_spy_gil), processes.CpuMeter(worker) as cpu:
        started = time.time()
        job = wait_job(submit("minilm", texts), args.timeout_s)
    elapsed = epoch(job.finished_at) - started
    count, size, run_ms, padding = batch_stats(services)
    cells: list[object] = [
        "",
        f"{run_ms / 1000:.2f}",
        count,
        f"{size:.1f}",
        f"{padding:.2f}",
        f"{run_ms / 1000 / elapsed:.0%}",
        *cores(cpu),
    ]
    return job.done / elapsed, cells, cpu.seconds["workers"]


# -- figure 2: noop, many single-item calls -------------------------------------------------------


@dataclass(frozen=True)
class System:
    name: str
    table: str
    start: Callable[[], WorkerProcess]
    publish: Callable[[int, str], object]


def noop_calls_section(args: argparse.Namespace, services: Services) -> None:
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
        drain = found.count / (found.last - ready)
        table.append(
            [
                system.name,
                "drain",
                publish_rate,
                drain,
                found.commit_rate(),
                f"{found.last - ready:.2f}",
                _batches(services, system),
                *cores(cpu)[1:],
            ]
        )
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
    e2e = found.count / (found.last - started)
    table.append(
        [
            system.name,
            "end-to-end",
            len(items) / (published - started),
            e2e,
            found.commit_rate(),
            f"{found.last - started:.2f}",
            _batches(services, system),
            *cores(cpu)[1:],
        ]
    )
    if profiler:
        print_profile(profiler, f"{len(items)} infer.delay calls")
    return e2e


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


# -- figure 3: noop, one large submit -------------------------------------------------------------


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


def noop_submit_section(args: argparse.Namespace, services: Services) -> None:
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
        print(f"  end to end {job.done / (finished - started):,.0f} items/s (target >= 100,000)")
        if profiler:
            print_profile(profiler)
    finally:
        worker.stop()
    print_problems([worker])
    services.truncate()


def _first_batch_start(services: Services) -> float:
    with services.db.connect() as conn:
        return epoch(conn.execute(text("SELECT min(started_at) FROM batches")).scalar_one())


# -- main -----------------------------------------------------------------------------------------


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
                minilm_section(args, found)
            if 2 in args.sections:
                noop_calls_section(args, found)
            if 3 in args.sections:
                noop_submit_section(args, found)
    except KeyboardInterrupt:
        print("\ninterrupted; workers stopped, Redis database flushed, schema dropped", file=sys.stderr)
        raise SystemExit(130) from None
    print(f"\nbench finished in {time.monotonic() - began:.0f} s")


if __name__ == "__main__":
    main()
