"""Figure 1 of bench.pipeline: MiniLM in a plain loop in the bench process (raw, and raw over the corpus
sorted by length) vs the same corpus through submit -> batchwork worker -> SQL (pipeline), at the same N.

Imports worker modules only inside functions, once bench.stack has pointed BATCHWORK_* at the bench.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from bench import processes, spy
from bench.processes import WorkerProcess
from bench.stack import (
    Services,
    batch_stats,
    batchwork_worker,
    cores,
    epoch,
    print_problems,
    print_table,
    ratio,
    wait_job,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("figure 1: MiniLM")
    g.add_argument("--minilm-n", type=int, default=64, help="N, raw batch size and max_batch_size")
    g.add_argument("--minilm-wait-ms", type=float, default=50)
    g.add_argument("--minilm-items", type=int, default=None, help="corpus size (default 2000, quick 600)")
    g.add_argument(
        "--minilm-reps", type=int, default=None, help="raw/pipeline alternations (default 2, quick 1)"
    )


def fill_defaults(args: argparse.Namespace) -> None:
    """The sizes --quick shrinks, where the command line gives none."""
    args.minilm_items = args.minilm_items or (600 if args.quick else 2000)
    args.minilm_reps = args.minilm_reps or (1 if args.quick else 2)


RAW, SORTED, PIPELINE = "raw", "raw sorted", "pipeline"


def run(args: argparse.Namespace, services: Services) -> None:
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
