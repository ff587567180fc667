"""How the scheduling core pays off: length buckets on real MiniLM, and priority lanes in a real worker.

1. MiniLM: batches formed by the pure ``Scheduler`` with length buckets vs without (arrival order), at
   the same token budget and N, then run through ``MiniLM.forward``: padding, batches, items/s; and the
   padding of finer bucket edges (the 8-token edges of minilm's defaults).
2. Priority under saturation: a ``simulated`` model (a + b*n ms per batch) in a real worker on a Redis and
   PostgreSQL of the bench's own: a bulk backlog keeps it busy while single-item jobs stream in, as ``high``
   (lanes) or as ``bulk`` (plain FIFO); then a high flood with a trickle of bulk jobs shows the starvation
   bound. Every figure is read back from the stored jobs and batch records.
Prints tables, never asserts. Run from the repository root: ``python -m bench.scheduling [--quick]``.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from bench import harness as h
from worker.batching.policy import LanePolicy
from worker.batching.scheduler import Batch, Item, Scheduler

EDGES = (16, 24, 32, 48, 64, 96, 128, 192)
VOCABULARY = (
    "the of and to in is was for that with as on by at from his her their it this be are an or which have "
    "has had not but were been one all new more when who will would there can about after into time year "
    "people way day world life work part place case week company system program group number night point "
    "home water room area money story fact month right study book job word business issue side kind head "
    "house service friend power hour game line end member law city community name team minute idea body "
    "information back face level office door health person art history party result change morning queue "
    "batch worker model latency throughput message broker database scheduler token embedding vector GPU "
    "quickly often never always carefully important different public national local early young major "
    "economic possible run make take see come know give find think tell become leave feel bring begin"
)
WORDS = VOCABULARY.split()


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smaller samples and shorter runs (about 2 min)")
    p.add_argument("--sections", default="1,2", help="which figures to run, e.g. 2")
    p.add_argument("--seed", type=int, default=11)
    g = p.add_argument_group("figure 1: MiniLM buckets")
    g.add_argument("--corpus-size", type=int, default=3000)
    g.add_argument("--min-words", type=int, default=5)
    g.add_argument("--max-words", type=int, default=120)
    g.add_argument("--max-batch-size", type=int, default=128, help="N of both policies")
    g.add_argument("--budgets", default="8192,4096,16384", help="max_batch_tokens; the first is timed twice")
    g.add_argument("--bucket-edges", default=",".join(map(str, EDGES)))
    g.add_argument("--max-wait-ms", type=float, default=200.0, help="T of the lane (MiniLM bulk: 4 x 50)")
    g.add_argument(
        "--clock-tokens-per-s", type=float, default=1500.0, help="fake clock: a batch takes padded/this s"
    )
    g.add_argument("--timed-tokens", type=int, default=None, help="padded tokens timed per config per round")
    g.add_argument("--rounds", type=int, default=2, help="a/b timing rounds at the first budget")
    g = p.add_argument_group("figure 2: priority lanes (Redis + PostgreSQL worker)")
    g.add_argument("--sim-base-ms", type=float, default=20.0, help="simulated model: a in a + b*n")
    g.add_argument("--sim-per-item-ms", type=float, default=1.0, help="simulated model: b in a + b*n")
    g.add_argument("--model-n", type=int, default=64, help="the model's N (high lane: N/8)")
    g.add_argument("--model-t-ms", type=float, default=20.0, help="the model's T (high lane: min(T, 5 ms))")
    g.add_argument("--bulk-n", type=int, default=64)
    g.add_argument("--stream-rate", type=float, default=5.0, help="single-item jobs per second")
    g.add_argument("--stream-s", type=float, default=None)
    g.add_argument("--alone-s", type=float, default=None, help="bulk alone before the stream")
    g.add_argument("--flood-s", type=float, default=None)
    g.add_argument("--flood-factor", type=float, default=1.5, help="high items offered / high capacity")
    g.add_argument("--trickle-every-s", type=float, default=0.5, help="one small bulk job this often")
    g.add_argument("--trickle-items", type=int, default=8)
    args = p.parse_args(argv)
    quick = args.quick
    defaults = {
        "timed_tokens": 4000 if quick else 30000,
        "stream_s": 6.0 if quick else 30.0,
        "alone_s": 3.0 if quick else 8.0,
        "flood_s": 4.0 if quick else 10.0,
    }
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.sections = {int(s) for s in args.sections.split(",") if s}
    args.budgets = [int(b) for b in args.budgets.split(",") if b]
    args.bucket_edges = tuple(int(e) for e in args.bucket_edges.split(",") if e)
    return args


def pct(value: float) -> str:
    return f"{100 * value:.1f} %"


# -- figure 1: MiniLM, bucketed vs unbucketed ----------------------------------------------------------


def corpus(size: int, seed: int, min_words: int, max_words: int) -> list[str]:
    """Sentences of uniformly mixed length, in random order (how a mixed job arrives)."""
    rng = random.Random(seed)
    return [
        " ".join(rng.choices(WORDS, k=rng.randint(min_words, max_words))).capitalize() + "."
        for _ in range(size)
    ]


@dataclass
class Formed:
    """One policy's batch list over the whole corpus, and the seconds measured for some of its batches."""

    name: str
    budget: int
    batches: list[Batch]

    @property
    def items(self) -> int:
        return sum(len(b.items) for b in self.batches)

    @property
    def padded(self) -> int:
        return sum(b.padded_tokens for b in self.batches)

    @property
    def padding(self) -> float:
        return (self.padded - sum(b.real_tokens for b in self.batches)) / self.padded

    def sample(self, timed_tokens: int, round_: int, rounds: int) -> list[Batch]:
        """About ``timed_tokens`` worth of batches, evenly spaced, shifted per round. The list runs short
        to long (items arrive at once; the oldest bucket goes first), so this is stratified by length."""
        count = max(1, min(len(self.batches), round(timed_tokens * len(self.batches) / self.padded)))
        step = len(self.batches) / count
        phase = round_ / max(1, rounds)
        return [self.batches[min(len(self.batches) - 1, int((j + phase) * step))] for j in range(count)]


def form_batches(
    lengths: Sequence[int], payloads: Sequence[Any], policy: LanePolicy, tps: float
) -> list[Batch]:
    """All items arrive at once; the fake clock moves by each batch's cost, as a busy worker's would."""
    scheduler = Scheduler(lambda _lane: policy)
    for index, (length, payload) in enumerate(zip(lengths, payloads, strict=True)):
        scheduler.add("minilm", "bulk", Item("corpus", index, length, 0.0, payload))
    clock, batches = 0.0, []
    while len(scheduler):
        batch = scheduler.next_batch(clock)
        if batch is None:
            clock = scheduler.next_deadline() or clock
            continue
        batches.append(batch)
        clock += batch.padded_tokens / tps
    return batches


def time_round(model: Any, a: list[Batch], b: list[Batch]) -> tuple[float, float]:
    """Seconds of a's and b's batches, run alternately (a, b, a, b, ...) so load drift hits both alike."""
    seconds = [0.0, 0.0]
    for i in range(max(len(a), len(b))):
        for side, batches in enumerate((a, b)):
            if i < len(batches):
                payloads = [item.ref for item in batches[i].items]
                started = time.perf_counter()
                model.forward(payloads)
                seconds[side] += time.perf_counter() - started
    return seconds[0], seconds[1]


def items_per_s(formed: Formed, sampled: list[Batch], seconds: float) -> float:
    """Measured seconds per padded token of the sample, times all padded tokens of the list."""
    sampled_padded = sum(b.padded_tokens for b in sampled)
    return formed.items / (seconds / sampled_padded * formed.padded)


def minilm_section(args: argparse.Namespace) -> None:
    import torch

    from worker.models.minilm import MiniLM
    from worker.settings import Settings

    print("\n== 1. MiniLM: length buckets vs arrival order, same N and token budget ==")
    model = MiniLM(Settings())
    model.load("cpu")
    texts = corpus(args.corpus_size, args.seed, args.min_words, args.max_words)
    prepared = model.prepare(texts)
    lengths = [p.length for p in prepared]
    payloads = [p.payload for p in prepared]
    print(
        f"knobs: corpus {len(texts)} sentences of {args.min_words}-{args.max_words} words "
        f"(seed {args.seed}), tokens {min(lengths)}-{max(lengths)} (mean {statistics.mean(lengths):.0f}); "
        f"N={args.max_batch_size}; "
        f"T={args.max_wait_ms:g} ms; (a) bucket_edges={args.bucket_edges}, (b) none; all items arrive at "
        f"once, fake clock += padded/{args.clock_tokens_per_s:g} tok/s per batch"
    )
    print(
        f"timing: evenly spaced batches of each list, about {args.timed_tokens} padded tokens, a/b batches "
        f"alternated; items/s = items / (measured s per padded token x all padded tokens); "
        f"torch threads {torch.get_num_threads()}"
    )
    model.forward(payloads[:16])  # warm-up
    rows, summary = [], []
    tps = args.clock_tokens_per_s
    for position, budget in enumerate(args.budgets):
        a, b = (
            Formed(name, budget, form_batches(lengths, payloads, _policy(args, budget, edges), tps))
            for name, edges in (("bucketed", args.bucket_edges), ("unbucketed", ()))
        )  # fmt: skip
        rounds = args.rounds if position == 0 else 1
        rates: dict[str, list[float]] = {a.name: [], b.name: []}
        timed = {a.name: 0, b.name: 0}
        for r in range(rounds):
            sa, sb = a.sample(args.timed_tokens, r, rounds), b.sample(args.timed_tokens, r, rounds)
            ta, tb = time_round(model, sa, sb)
            rates[a.name].append(items_per_s(a, sa, ta))
            rates[b.name].append(items_per_s(b, sb, tb))
            timed[a.name] += len(sa)
            timed[b.name] += len(sb)
        for formed in (a, b):
            rows.append(_formed_row(formed, rates[formed.name], timed[formed.name]))
        ra, rb = statistics.median(rates[a.name]), statistics.median(rates[b.name])
        per_round = ", ".join(h.ratio(x, y) for x, y in zip(rates[a.name], rates[b.name], strict=True))
        summary.append(
            (budget, pct(a.padding), "yes" if a.padding <= 0.10 else "NO", h.ratio(ra, rb), per_round)
        )
    headers = ["policy", "max_batch_tokens", "batches", "mean size", "padded %", "timed batches"]
    h.print_table([*headers, "items/s (median)"], rows)
    print()
    h.print_table(
        ["max_batch_tokens", "bucketed padding", "<= 10 %", "items/s bucketed/unbucketed", "per round"],
        summary,
    )
    print()
    _print_edge_choices(args, lengths, payloads)


def _print_edge_choices(args: argparse.Namespace, lengths: Sequence[int], payloads: Sequence[Any]) -> None:
    """Padding only (no timing): how fine the buckets must be for the padding target, at the first budget."""
    budget = args.budgets[0]
    choices = [
        ("as above", args.bucket_edges),
        ("every 16 to 256", tuple(range(16, 257, 16))),
        ("every 8 to 256", tuple(range(8, 257, 8))),
    ]
    rows: list[list[object]] = []
    for name, edges in choices:
        policy = _policy(args, budget, edges)
        formed = Formed(name, budget, form_batches(lengths, payloads, policy, args.clock_tokens_per_s))
        rows.append([name, len(edges) + 1, len(formed.batches), pct(formed.padding)])
    ideal = _sorted_padding(lengths, args.max_batch_size, budget)
    rows.append(["whole corpus sorted (floor)", "-", ideal[1], pct(ideal[0])])
    print(f"bucket edges vs padding at max_batch_tokens={budget}, N={args.max_batch_size} (scheduler only):")
    h.print_table(["bucket_edges", "buckets", "batches", "padded %"], rows)


def _sorted_padding(lengths: Sequence[int], n: int, budget: int) -> tuple[float, int]:
    """Padding of greedy batches over the length-sorted corpus: what perfect bucketing would reach."""
    ordered, padded, batches, i = sorted(lengths), 0, 0, 0
    while i < len(ordered):
        j = i + 1
        while j < len(ordered) and j - i < n and ordered[j] * (j - i + 1) <= budget:
            j += 1
        padded += ordered[j - 1] * (j - i)
        batches += 1
        i = j
    return (padded - sum(ordered)) / padded, batches


def _policy(args: argparse.Namespace, budget: int, edges: tuple[int, ...]) -> LanePolicy:
    return LanePolicy(
        args.max_batch_size, args.max_wait_ms / 1000, max_batch_tokens=budget, bucket_edges=edges
    )


def _formed_row(formed: Formed, rates: list[float], timed: int) -> list[object]:
    size = formed.items / len(formed.batches)
    return [
        formed.name,
        formed.budget,
        len(formed.batches),
        size,
        pct(formed.padding),
        timed,
        statistics.median(rates),
    ]


# -- figure 2: priority lanes --------------------------------------------------------------------------


def lanes_section(args: argparse.Namespace) -> None:
    kn = knobs_of(args)
    high, bulk = kn.policy("high"), kn.policy("bulk")
    print("\n== 2. Priority under saturation: simulated model through Redis + PostgreSQL + one worker ==")
    print(
        f"knobs: batch = {kn.base_ms:g} + {kn.per_item_ms:g}*n ms; model N={kn.model_n}, "
        f"T={kn.model_t_ms:g} ms; high lane N={high.max_batch_size}, T={high.max_wait_s * 1000:g} ms; "
        f"bulk lane N={bulk.max_batch_size}, "
        f"T={bulk.max_wait_s * 1000:g} ms, max_delay={bulk.max_delay_s:g} s (longest bulk batch "
        f"{kn.batch_ms(kn.bulk_n):g} ms, bulk capacity {kn.bulk_items_per_s():.0f} items/s); stream "
        f"{args.stream_rate:g} single-item jobs/s for {args.stream_s:g} s behind a bulk backlog; "
        f"bulk alone {args.alone_s:g} s before it"
    )
    with stack() as st:
        runs = [stream_run(st, args, "lanes (high)", "high", None)]
        runs.append(stream_run(st, args, "FIFO (as bulk)", "bulk", None))
        _print_stream_runs(runs, high.max_wait_s * 1000, kn, bulk.max_delay_s)
        flood = flood_run(st, args)
        _print_flood(flood, args, kn)


def _print_stream_runs(runs: list[StreamRun], high_t_ms: float, kn: Knobs, max_delay_s: float) -> None:
    nominal = 1.25 * (kn.batch_ms(kn.bulk_n) + high_t_ms)
    rows = []
    for run in runs:
        longest = max(run.bulk_runs_ms, default=float("nan"))
        bound = 1.25 * (longest + high_t_ms)
        p99 = percentile(run.latencies_ms, 0.99)
        rows.append(
            [
                run.name,
                f"{len(run.latencies_ms)}/{len(run.latencies_ms) + run.unfinished}",
                run.offered_per_s,
                percentile(run.latencies_ms, 0.5),
                p99,
                max(run.latencies_ms, default=float("nan")),
                percentile(run.bulk_runs_ms, 0.99),
                longest,
                bound,
                _met(p99 <= bound, run.unfinished),
                _met(p99 <= nominal, run.unfinished),
            ]
        )
    print(
        "\nstream-job latency (stored finished_at - created_at), ms; bound = 1.25 x (longest bulk + T_high):"
    )
    h.print_table(
        [
            "run",
            "finished",
            "jobs/s",
            "p50",
            "p99",
            "max",
            "bulk batch p99",
            "longest",
            "bound",
            "p99 <= bound",
            f"p99 <= {nominal:.0f} (a+b*N)",
        ],
        rows,
    )
    print(f"\nhigh batches during the stream (own cost a+b = {kn.batch_ms(1):g} ms for one item):")
    h.print_table(
        ["run", "high batches", "mean size", "wait p50 ms", "wait p99 ms", "wait max ms", "run mean ms"],
        [_high_row(run) for run in runs if run.high_batches],
    )
    print("\nbulk throughput, items/s (from bulk batch records, by start time):")
    h.print_table(
        ["run", "bulk alone", "with the stream", "with / alone", "expected with / alone"],
        [
            [
                run.name,
                run.alone_items_per_s,
                run.with_items_per_s,
                h.ratio(run.with_items_per_s, run.alone_items_per_s),
                f"{1 - run.offered_per_s * kn.batch_ms(1) / 1000:.2f}x",
            ]
            for run in runs
            if run.alone_items_per_s == run.alone_items_per_s
        ],
    )
    print("  (expected: each single-item high batch takes a+b ms of the model away from bulk)")
    print(f"\nbulk batches during the stream: oldest item's wait vs bulk's max_delay ({max_delay_s:g} s):")
    h.print_table(
        ["run", "bulk batches", "wait min s", "wait p50 s", "wait max s", "past the bound"],
        [_bulk_wait_row(run, max_delay_s) for run in runs],
    )


def _bulk_wait_row(run: StreamRun, max_delay_s: float) -> list[object]:
    waits = [w / 1000 for w in run.bulk_waits_ms]
    past = sum(w >= max_delay_s for w in waits)
    return [
        run.name,
        len(waits),
        min(waits, default=float("nan")),
        percentile(waits, 0.5),
        max(waits, default=float("nan")),
        pct(past / len(waits)) if waits else "n/a",
    ]


def _met(ok: bool, unfinished: int) -> str:
    return "n/a" if unfinished else ("yes" if ok else "NO")


def _high_row(run: StreamRun) -> list[object]:
    waits = [b.wait_ms for b in run.high_batches]
    return [
        run.name,
        len(run.high_batches),
        statistics.mean(b.size for b in run.high_batches),
        percentile(waits, 0.5),
        percentile(waits, 0.99),
        max(waits),
        statistics.mean(b.run_ms for b in run.high_batches),
    ]


def _print_flood(flood: FloodRun, args: argparse.Namespace, kn: Knobs) -> None:
    bound_s = kn.policy("bulk").max_delay_s
    high_n = kn.policy("high").max_batch_size
    starts = [b.started_at.timestamp() for b in flood.bulk_batches]
    gaps = [later - earlier for earlier, later in zip(starts, starts[1:], strict=False)]
    waits = [b.wait_ms for b in flood.bulk_batches]
    # Aging makes bulk eligible at the bound; it still waits for the high batch already running.
    slack_ms = bound_s * 1000 + kn.batch_ms(high_n)
    print(
        f"\nstarvation: high jobs of {high_n} items at {args.flood_factor:g}x the high lane's capacity "
        f"({high_n / kn.batch_ms(high_n) * 1000:.0f} items/s) for {flood.flood_s:.1f} s, one bulk job of "
        f"{args.trickle_items} items every {args.trickle_every_s:g} s; bound = bulk max_delay "
        f"max(40 x T_model, 2 s) = {bound_s:g} s"
    )
    h.print_table(
        [
            "high offered/s",
            "high served/s",
            "bulk batches",
            "bulk wait max ms",
            "max gap between bulk batches s",  # up to the bound + the trickle period
            "bulk job latency max ms",
            "bulk unfinished",
            f"wait max <= bound + 1 high batch ({slack_ms:,.0f} ms)",
        ],
        [
            [
                flood.offered_high_per_s,
                flood.served_high_per_s,
                len(flood.bulk_batches),
                max(waits, default=float("nan")),
                max(gaps, default=float("nan")),
                max(flood.bulk_latencies_ms, default=float("nan")),
                flood.bulk_unfinished,
                "yes" if waits and max(waits) <= slack_ms else "NO",
            ]
        ],
    )


MODEL = "simulated"


@dataclass
class Stack:
    found: h.Stack
    store: Any  # worker.store.results.ResultStore, imported once BATCHWORK_* point here

    def reset(self) -> None:
        """Between runs: no message, job, result or batch of the previous run is left."""
        self.found.broker.flushdb()
        self.found.truncate()


@contextmanager
def stack() -> Iterator[Stack]:
    with h.stack() as found:
        from worker.store.results import ResultStore

        store = ResultStore.from_url(found.database_url)
        try:
            yield Stack(found, store)
        finally:
            store.close()


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


def start_worker(st: Stack, name: str, settings: dict[str, Any]) -> h.Proc:
    worker = h.worker(st.found, name, **settings)
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
        # A job from infer.delay has no SQL row until a worker stores its first outcome: None is pending.
        pending = [j for j in pending if getattr(st.store.status(j), "finished_at", None) is None]
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


# -- main ---------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    h.header("bench.scheduling", args)
    began = time.monotonic()
    try:
        if 1 in args.sections:
            minilm_section(args)
        if 2 in args.sections:
            lanes_section(args)
    except KeyboardInterrupt:
        print("\ninterrupted; workers and servers stopped", file=sys.stderr)
        raise SystemExit(130) from None
    print(f"\nbench finished in {time.monotonic() - began:.0f} s (load average now {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
