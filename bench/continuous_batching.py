"""Continuous vs static vs one-at-a-time batching of one GPT2 engine, and static batching as a server
calling transformers' generate does it, under steady arrivals, on wall time.

It drives ``worker.models.gpt2.GPT2`` (the generate kind's step loop over gpt2's own network) directly
(no Celery) on a random-weight GPT-2 checkpoint it builds in a temp dir (reused by later runs), and prints
tokens/s, request latency and a step-cost table explaining them. ``--networks`` instead runs the same
requests through gpt2's network and through the generic path (``generate:`` over the same directory),
both under the same engine and settings, and checks both against transformers' greedy ``generate``.
It never asserts and never downloads. Run from the repository root:
``python -m bench.continuous_batching [--quick] [--networks]``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from bench import harness as h
from bench.batched_runs import Request, WallClock, run_continuous, run_static
from bench.harness import cached_checkpoint
from worker.batching.sequences import Generation, pages_for
from worker.models.causal_lm.inputs import Prompt
from worker.models.causal_lm.model import PAGE_TOKENS, CausalLM
from worker.models.gpt2 import GPT2
from worker.models.registry import parse_model_entry, spec_class
from worker.settings import Settings

PROMPT_TOKENS = (5, 40)
NEW_TOKENS = (8, 256)
# The step-cost table decodes from prompts as long as the workload's mean prompt, and as long as its
# longest requests grow (40 + 256 tokens would be the very longest).
SHORT_PROMPT_TOKENS = 22
LONG_PROMPT_TOKENS = 256
PROBE_STEPS = 32


@dataclass(frozen=True, slots=True)
class ModelShape:
    layers: int
    heads: int
    width: int
    positions: int
    vocab: int  # 0: the tokenizer's own

    def describe(self, vocab: int) -> str:
        return (
            f"n_layer={self.layers} n_head={self.heads} n_embd={self.width} n_positions={self.positions} "
            f"vocab_size={vocab}"
        )


# A request with its arrival time, as the drivers of bench.batched_runs take it. A type only: build
# one with Request(...), since a frozen slotted dataclass cannot be called through its subscripted alias.
Arrival = Request[Prompt]


@dataclass
class Run:
    """One policy's outcome: per request its admission and finish offsets and tokens; per step its batch
    and wall time."""

    policy: str
    admit_s: dict[Hashable, float] = field(default_factory=dict)
    finish_s: dict[Hashable, float] = field(default_factory=dict)
    tokens: dict[Hashable, tuple[int, ...]] = field(default_factory=dict)
    reasons: dict[Hashable, str | None] = field(default_factory=dict)
    step_batches: list[int] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    preemptions: int = 0

    def latencies_s(self, arrivals: Sequence[Arrival]) -> list[float]:
        return [self.finish_s[a.key] - a.arrival_s for a in arrivals]

    def makespan_s(self) -> float:
        return max(self.finish_s.values())

    def generated(self) -> int:
        return sum(map(len, self.tokens.values()))

    def tokens_per_s(self) -> float:
        return self.generated() / self.makespan_s()


class Recorded:
    """The engine as a driver sees it, recording each admission and each step into a Run. A step is
    ``GPT2.advance``, so the run keeps every request's token ids, not only its text."""

    def __init__(self, engine: CausalLM, run: Run) -> None:
        self.engine, self.run = engine, run
        self.max_running = engine.max_running
        self.clock = WallClock()  # the run starts now; the driver is handed this clock
        self._preempted = engine.preemptions

    def can_admit(self, length: int) -> bool:
        return self.engine.can_admit(length)

    def running(self) -> int:
        return self.engine.running()

    def admit(self, key: Hashable, payload: Prompt) -> None:
        self.engine.admit(key, payload)
        self.run.admit_s[key] = self.clock.now_s()

    def step(self) -> list[Generation]:
        run = self.run
        run.step_batches.append(self.engine.running())
        before = time.monotonic()
        generations = self.engine.advance()
        run.step_s.append(time.monotonic() - before)
        now = self.clock.now_s()
        for generation in generations:
            run.finish_s[generation.key] = now
            run.tokens[generation.key] = generation.token_ids
            run.reasons[generation.key] = generation.error or generation.finish_reason
        return generations

    def finished(self) -> Run:
        self.run.preemptions = self.engine.preemptions - self._preempted
        return self.run


class FixedShape(Recorded):
    """Our engine run as a fixed-shape batch (generate's): a static batch is admitted whole at its first
    step, every row asking for the batch's largest max_new_tokens, so none leaves before the batch ends;
    each keeps its own first max_new_tokens and is answered when the batch ends. Only for run_static, which
    asks ``can_admit`` while the engine is idle and before the batch is admitted: the KV budget holds every
    slot's worst case (load_engine), so the batch size alone limits a batch."""

    def __init__(self, engine: CausalLM, run: Run) -> None:
        super().__init__(engine, run)
        self._taken: list[tuple[Hashable, Prompt]] = []
        self._asked: dict[Hashable, int] = {}  # the batch in flight: each row's own max_new_tokens

    def running(self) -> int:
        return self.engine.running() + len(self._taken)

    def admit(self, key: Hashable, payload: Prompt) -> None:
        self._taken.append((key, payload))

    def step(self) -> list[Generation]:
        if self._taken:
            steps = max(prompt.max_new_tokens for _, prompt in self._taken)
            for key, prompt in self._taken:
                self._asked[key] = prompt.max_new_tokens
                super().admit(key, replace(prompt, max_new_tokens=steps))
            self._taken = []
        generations = super().step()
        if not self.engine.running():
            now = self.clock.now_s()
            for key, asked in self._asked.items():
                self.run.finish_s[key] = now
                self.run.tokens[key] = self.run.tokens[key][:asked]
            self._asked = {}
        return generations


# -- the checkpoint --------------------------------------------------------------------------------


def checkpoint_for(shape: ModelShape, seed: int) -> Path:
    """A GPT-2-format checkpoint of ``shape`` in the temp dir, built once per shape and seed."""
    name = f"batchwork-bench-gpt2-{shape.layers}x{shape.heads}x{shape.width}x{shape.positions}"
    return cached_checkpoint(f"{name}-v{shape.vocab}-s{seed}", lambda d: build_checkpoint(d, shape, seed))


def build_checkpoint(directory: Path, shape: ModelShape, seed: int) -> None:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from tests.integration.tiny_gpt2 import INITIALIZER_RANGE, _tokenizer

    tokenizer = _tokenizer()
    tokenizer.save_pretrained(directory)
    config = GPT2Config(
        n_layer=shape.layers,
        n_head=shape.heads,
        n_embd=shape.width,
        n_positions=shape.positions,
        vocab_size=max(shape.vocab, len(tokenizer)),
        initializer_range=INITIALIZER_RANGE,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(config).eval()
    # EOS's (tied) embedding row zeroed: with ln_f's zero bias its logit is exactly 0, far below the largest
    # of the other random logits at every step, so greedy decoding never ends by EOS and max_new_tokens
    # alone sets each request's length (the "eos" count in the output checks this).
    with torch.no_grad():
        model.transformer.wte.weight[tokenizer.eos_token_id].zero_()
    model.save_pretrained(directory)


def load_engine(checkpoint: Path, max_batch: int, device: str, generic: bool = False) -> CausalLM:
    """gpt2 (its own network), or with ``generic`` the generate kind over the same directory (the model
    transformers loads, attention ours); the same options either way."""
    # Room for max_batch sequences at their worst case: the KV cache never limits a policy, only the slots.
    worst = PROMPT_TOKENS[1] + NEW_TOKENS[1]
    budget = max_batch * pages_for(worst, PAGE_TOKENS) * PAGE_TOKENS
    options = {"kv_budget_tokens": budget, "max_running": max_batch}
    if generic:
        spec = parse_model_entry(f"generate:{checkpoint}")
        cls = spec_class(spec)
        settings = Settings(model_options={spec.name: options})
    else:
        cls, settings = GPT2, Settings(model_options={"gpt2": options | {"path": str(checkpoint)}})
    engine = cls(settings)
    assert isinstance(engine, CausalLM)
    engine.load(device)
    return engine


# -- the workload ----------------------------------------------------------------------------------


def workload(count: int, vocab: int, eos: int, seed: int) -> list[Prompt]:
    """Prompts of 5-40 random tokens; max_new_tokens log-uniform over 8-256, so most are short, a few long."""
    rng = random.Random(seed)
    tokens = [t for t in range(vocab) if t != eos]
    low, high = math.log(NEW_TOKENS[0]), math.log(NEW_TOKENS[1])
    return [
        Prompt(
            tuple(rng.choices(tokens, k=rng.randint(*PROMPT_TOKENS))),
            max_new_tokens=round(math.exp(rng.uniform(low, high))),
        )
        for _ in range(count)
    ]


def steady(prompts: Sequence[Prompt], interval_s: float) -> list[Arrival]:
    return [Request(i, prompt, prompt.kv_tokens, i * interval_s) for i, prompt in enumerate(prompts)]


# -- the policies: bench.batched_runs's two drivers, recorded ------------------------------


def measure_continuous(engine: CausalLM, arrivals: Sequence[Arrival]) -> Run:
    """Before every step, admit whatever has arrived while ``can_admit`` allows; a finished one leaves."""
    recorded = Recorded(engine, Run("continuous"))
    run_continuous(recorded, arrivals, recorded.clock)
    return recorded.finished()


def measure_static(engine: CausalLM, arrivals: Sequence[Arrival], batch_size: int, policy: str) -> Run:
    """When the engine is free, take what has arrived (up to ``batch_size``; else wait for the next
    arrival) and run that batch to its end with no admissions; ``batch_size=1`` is one at a time. A
    finished row leaves the batch and costs nothing more."""
    recorded = Recorded(engine, Run(policy))
    run_static(recorded, arrivals, batch_size, recorded.clock)
    return recorded.finished()


def measure_fixed(engine: CausalLM, arrivals: Sequence[Arrival], batch_size: int) -> Run:
    """``measure_static``, but a finished row keeps its place, as in a fixed-shape batch (see FixedShape)."""
    recorded = FixedShape(engine, Run("static, fixed"))
    run_static(recorded, arrivals, batch_size, recorded.clock)
    return recorded.finished()


def measure_generate(checkpoint: Path, arrivals: Sequence[Arrival], batch_size: int) -> Run:
    """Static batching as a server does it that hands each batch to transformers' ``generate`` (Ray
    Serve's @serve.batch, TorchServe or Triton's dynamic batcher in front of it): when free, take what has
    arrived (up to ``batch_size``), left-pad it, and generate to the batch's largest max_new_tokens, every
    row computed until then; each request keeps its own first max_new_tokens and is answered when the
    batch returns. Unlike ``measure_static`` a finished row keeps its place in the batch."""
    import torch
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(str(checkpoint), local_files_only=True).eval()
    with torch.inference_mode():
        generate_batch(model, [a.payload for a in arrivals[:batch_size]], 8)  # warm-up, untimed
    batches = GenerateBatches(model, batch_size, Run("static, generate"))
    run_static(batches, arrivals, batch_size, batches.clock)
    return batches.run


class GenerateBatches:
    """transformers' generate as run_static drives a model: a batch is admitted whole, and its one step
    generates every row to the batch's largest max_new_tokens (recorded as that many steps of equal
    time)."""

    def __init__(self, model: Any, max_running: int, run: Run) -> None:
        self.model, self.max_running, self.run = model, max_running, run
        self.clock = WallClock()
        self._batch: list[tuple[Hashable, Prompt]] = []

    def can_admit(self, length: int) -> bool:
        return True  # run_static's batch_size is the only limit

    def running(self) -> int:
        return len(self._batch)

    def admit(self, key: Hashable, payload: Prompt) -> None:
        self._batch.append((key, payload))
        self.run.admit_s[key] = self.clock.now_s()

    def step(self) -> list[Generation]:
        import torch

        prompts = [prompt for _, prompt in self._batch]
        steps = max(prompt.max_new_tokens for prompt in prompts)
        before = time.monotonic()
        with torch.inference_mode():
            generated = generate_batch(self.model, prompts, steps)
        elapsed, finished = time.monotonic() - before, self.clock.now_s()
        self.run.step_batches += [len(prompts)] * steps
        self.run.step_s += [elapsed / steps] * steps
        done = [
            Generation(key, tokens[: prompt.max_new_tokens], "length")
            for (key, prompt), tokens in zip(self._batch, generated, strict=True)
        ]
        for generation in done:
            self.run.finish_s[generation.key] = finished
            self.run.tokens[generation.key] = generation.token_ids
            self.run.reasons[generation.key] = generation.finish_reason
        self._batch = []
        return done


def generate_batch(model: Any, prompts: Sequence[Prompt], steps: int) -> list[tuple[int, ...]]:
    """transformers' greedy generate of ``steps`` tokens for each of the prompts, left-padded with EOS:
    each row's new token ids."""
    import torch

    pad = model.config.eos_token_id
    longest = max(len(prompt.token_ids) for prompt in prompts)
    rows = [(longest - len(prompt.token_ids), prompt.token_ids) for prompt in prompts]
    ids = torch.tensor([[pad] * padding + list(tokens) for padding, tokens in rows])
    mask = torch.tensor([[0] * padding + [1] * len(tokens) for padding, tokens in rows])
    out = model.generate(
        ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=steps,
        min_new_tokens=steps,
        pad_token_id=pad,
    )
    return [tuple(row[longest:].tolist()) for row in out]


# -- step cost -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StepCost:
    """Median decode step with ``batch`` sequences decoding from short prompts, from long ones, and
    mixed (one long among short ones); and prefilling ``batch`` short prompts together."""

    batch: int
    short_s: float
    long_s: float
    mixed_s: float
    prefill_s: float


def step_costs(engine: CausalLM, batches: Sequence[int], vocab: int, rounds: int) -> list[StepCost]:
    """Each figure the best of ``rounds``, the rounds sweeping every batch size in turn, so a burst of
    outside load hits one round of each rather than every round of one."""
    rng = random.Random(0)
    best: dict[tuple[int, str], float] = {}
    for _ in range(rounds):
        for batch in batches:
            short, long = [SHORT_PROMPT_TOKENS] * batch, [LONG_PROMPT_TOKENS] * batch
            figures = {
                "prefill": probe(engine, short, vocab, rng)[0],
                "short": probe(engine, short, vocab, rng)[1],
                "long": probe(engine, long, vocab, rng)[1],
                "mixed": probe(engine, [LONG_PROMPT_TOKENS, *short[1:]], vocab, rng)[1],
            }
            for name, seconds in figures.items():
                best[batch, name] = min(best.get((batch, name), math.inf), seconds)
    return [
        StepCost(b, best[b, "short"], best[b, "long"], best[b, "mixed"], best[b, "prefill"]) for b in batches
    ]


def probe(
    engine: CausalLM, prompt_tokens: Sequence[int], vocab: int, rng: random.Random
) -> tuple[float, float]:
    """Prefill time of these prompts together, and the median of the PROBE_STEPS decode steps after it."""
    for key, length in enumerate(prompt_tokens):
        prompt = tuple(rng.randrange(1, vocab) for _ in range(length))
        engine.admit(("probe", key), Prompt(prompt, PROBE_STEPS + 1))
    before = time.monotonic()
    engine.advance()
    prefill_s = time.monotonic() - before
    steps = []
    while engine.running():
        before = time.monotonic()
        engine.advance()
        steps.append(time.monotonic() - before)
    return prefill_s, statistics.median(steps)


# -- reporting -------------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def print_step_costs(costs: Sequence[StepCost]) -> None:
    print(
        f"\ndecode step cost (ms, median of {PROBE_STEPS} steps, best of rounds): every sequence from a "
        f"{SHORT_PROMPT_TOKENS}-token prompt (short), a {LONG_PROMPT_TOKENS}-token one (long), or one long "
        f"among short ones (mixed); prefill: the batch's short prompts together"
    )
    h.print_table(
        ["batch", "short", "ms/token", "vs batch 1", "long", "mixed", "prefill"],
        [[c.batch, f"{c.short_s * 1e3:.2f}", f"{c.short_s * 1e3 / c.batch:.2f}",
          f"{c.short_s / costs[0].short_s:.2f}x", f"{c.long_s * 1e3:.2f}",
          f"{c.mixed_s * 1e3:.2f}" if c.batch > 1 else "-", f"{c.prefill_s * 1e3:.1f}"] for c in costs],
    )  # fmt: skip


def print_runs(runs: Sequence[Run], arrivals: Sequence[Arrival]) -> None:
    print()
    h.print_table(
        ["policy", "tokens/s", "makespan s", "p50 lat s", "p99 lat s", "steps", "batch", "step ms"],
        [[run.policy, f"{run.tokens_per_s():.0f}", f"{run.makespan_s():.2f}",
          *(f"{percentile(run.latencies_s(arrivals), q):.2f}" for q in (50, 99)), len(run.step_s),
          f"{statistics.fmean(run.step_batches):.1f}", f"{statistics.fmean(run.step_s) * 1e3:.2f}"]
         for run in runs],
    )  # fmt: skip
    print("(batch: mean running sequences per step; step ms: mean wall time of one engine.advance())")


def print_ratios(continuous: Run, statics: Sequence[Run], arrivals: Sequence[Arrival]) -> None:
    print()
    for static in statics:
        throughput = continuous.tokens_per_s() / static.tokens_per_s()
        p99 = percentile(continuous.latencies_s(arrivals), 99) / percentile(static.latencies_s(arrivals), 99)
        print(
            f"continuous / {static.policy}: tokens/s {throughput:.2f}x (target >= 2x: "
            f"{_verdict(throughput >= 2)}), p99 latency {p99:.2f}x (target < 1x: {_verdict(p99 < 1)})"
        )
    print(
        "(static: finished rows leave the batch, none join; static, fixed: our engine, every row computed to "
        "the batch's longest, as in a fixed-shape batch; static, generate: transformers' generate per batch, "
        "the same way)"
    )


def _verdict(met: bool) -> str:
    return "met" if met else "MISSED"


def print_agreement(runs: Sequence[Run], arrivals: Sequence[Arrival]) -> None:
    reference = runs[0]
    differing = [a.key for a in arrivals if any(run.tokens[a.key] != reference.tokens[a.key] for run in runs)]
    names = ", ".join(run.policy for run in runs)
    same = len(arrivals) - len(differing)
    print(f"greedy token ids identical across {names}: {same}/{len(arrivals)} requests")
    for index in differing[:5]:
        first = min(_first_difference(run.tokens[index], reference.tokens[index]) for run in runs)
        print(f"  request {index} differs from token {first} on")
    reasons = [run.reasons[a.key] for run in runs for a in arrivals]
    counts = {str(reason): reasons.count(reason) for reason in set(reasons)}
    print(f"finish reasons over all runs: {counts}; KV-cache preemptions: {sum(r.preemptions for r in runs)}")


def _first_difference(ours: Sequence[int], theirs: Sequence[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), len(ours))


# -- gpt2's network vs the generic path (--networks) -----------------------------------------------


def compare_networks(args: argparse.Namespace, checkpoint: Path, vocab: int, eos: int) -> None:
    """The same requests through gpt2's own network and through the generic path, side by side: step
    costs at batch 1 and ``--max-batch``, then the whole workload (all queued at once) continuously
    batched, each the best of ``--reps`` runs taken in turn; then both runs' ids against transformers'
    greedy ``generate`` one request at a time."""
    engines = {
        "gpt2 network": load_engine(checkpoint, args.max_batch, args.device),
        "generic": load_engine(checkpoint, args.max_batch, args.device, generic=True),
    }
    batches = sorted({1, args.max_batch})
    for engine in engines.values():  # untimed: the process's first kernels (allocator, oneDNN) warm up
        probe(engine, [SHORT_PROMPT_TOKENS], vocab, random.Random(0))
    rounds: dict[str, list[list[StepCost]]] = {name: [] for name in engines}
    for _ in range(1 if args.quick else 2):
        for name, engine in engines.items():
            rounds[name].append(step_costs(engine, batches, vocab, rounds=1))
    costs = {name: best_of(runs) for name, runs in rounds.items()}
    prompts = workload(args.requests or (24 if args.quick else 64), vocab, eos, args.seed)
    arrivals = steady(prompts, 0.0)
    runs: dict[str, Run] = {}
    # CPU seconds of this process per run as well as wall time: on a shared box other processes stretch
    # the wall time of whichever run they overlap, but hardly the CPU time our one thread spends.
    cpu_s: dict[str, float] = {}
    for _ in range(args.reps):
        for name, engine in engines.items():
            before = time.process_time()
            run = measure_continuous(engine, arrivals)
            cpu_s[name] = min(cpu_s.get(name, math.inf), time.process_time() - before)
            if name not in runs or run.tokens_per_s() > runs[name].tokens_per_s():
                runs[name] = run
    reference = reference_ids(checkpoint, prompts)
    print_networks(costs, runs, prompts, reference)
    ours, generic = engines
    print(
        f"CPU seconds of the run (least of {args.reps}): {ours} {cpu_s[ours]:.2f}, {generic} "
        f"{cpu_s[generic]:.2f}; generic / gpt2 network {cpu_s[generic] / cpu_s[ours]:.2f}x"
    )


def best_of(rounds: Sequence[Sequence[StepCost]]) -> list[StepCost]:
    """Each figure the least of the rounds'."""
    return [
        StepCost(
            costs[0].batch,
            min(c.short_s for c in costs),
            min(c.long_s for c in costs),
            min(c.mixed_s for c in costs),
            min(c.prefill_s for c in costs),
        )
        for costs in zip(*rounds, strict=True)
    ]


def reference_ids(checkpoint: Path, prompts: Sequence[Prompt]) -> list[tuple[int, ...]]:
    """transformers' greedy ``generate`` (do_sample=False), one request at a time: each one's new ids."""
    import torch
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(str(checkpoint), local_files_only=True).eval()
    with torch.inference_mode():
        return [generate_batch(model, [prompt], prompt.max_new_tokens)[0] for prompt in prompts]


def print_networks(
    costs: dict[str, list[StepCost]],
    runs: dict[str, Run],
    prompts: Sequence[Prompt],
    reference: Sequence[tuple[int, ...]],
) -> None:
    (ours, generic) = runs  # the two names, gpt2's network first
    print(
        f"\ndecode step ms (median of {PROBE_STEPS} steps, best of rounds taken in turn): from "
        f"{SHORT_PROMPT_TOKENS}-token prompts (short), {LONG_PROMPT_TOKENS}-token ones (long); prefill: the "
        "batch's short prompts, one sequence a forward"
    )
    h.print_table(
        ["network", "batch", "short", "long", "mixed", "prefill"],
        [[name, c.batch, f"{c.short_s * 1e3:.2f}", f"{c.long_s * 1e3:.2f}",
          f"{c.mixed_s * 1e3:.2f}" if c.batch > 1 else "-", f"{c.prefill_s * 1e3:.1f}"]
         for name, figures in costs.items() for c in figures],
    )  # fmt: skip
    for mine, theirs in zip(costs[ours], costs[generic], strict=True):
        ratios = {
            "short": theirs.short_s / mine.short_s,
            "long": theirs.long_s / mine.long_s,
            "prefill": theirs.prefill_s / mine.prefill_s,
        }
        shown = ", ".join(f"{name} {ratio:.2f}x" for name, ratio in ratios.items())
        print(f"generic / gpt2 network step time at batch {mine.batch}: {shown}")
    new_tokens = [p.max_new_tokens for p in prompts]
    print(
        f"\nworkload: {len(prompts)} requests queued at once, prompts "
        f"{min(len(p.token_ids) for p in prompts)}-{max(len(p.token_ids) for p in prompts)} tokens, "
        f"max_new_tokens {min(new_tokens)}-{max(new_tokens)} (sum {sum(new_tokens)}), greedy, continuous"
    )
    for name, run in runs.items():
        print(
            f"{name:>14}: {run.tokens_per_s():.0f} tokens/s, makespan {run.makespan_s():.2f} s, "
            f"{len(run.step_s)} steps of {statistics.fmean(run.step_s) * 1e3:.2f} ms, mean batch "
            f"{statistics.fmean(run.step_batches):.1f}"
        )
    print(f"gpt2 network / generic tokens/s: {runs[ours].tokens_per_s() / runs[generic].tokens_per_s():.2f}x")
    for name, run in runs.items():
        differing = [i for i, ids in enumerate(reference) if run.tokens[i] != ids]
        firsts = ", ".join(
            f"request {i} from token {_first_difference(run.tokens[i], reference[i])} of {len(reference[i])}"
            for i in differing
        )
        print(
            f"{name}: greedy ids equal transformers' generate(do_sample=False) for "
            f"{len(prompts) - len(differing)}/{len(prompts)}" + (f" (differ: {firsts})" if differing else "")
        )
    same = sum(runs[ours].tokens[i] == runs[generic].tokens[i] for i in range(len(prompts)))
    print(f"gpt2 network and generic give the same ids for {same}/{len(prompts)}")


# -- main ------------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests, one probe round (~90 s)")
    parser.add_argument("--requests", type=int, default=0, help="requests (0: 128, or 40 with --quick)")
    parser.add_argument("--max-batch", type=int, default=16, help="most running sequences, all policies")
    parser.add_argument(
        "--load",
        type=float,
        default=0.8,
        help="offered tokens/s over the measured full-batch mixed decode rate; sets the arrival interval",
    )
    parser.add_argument("--interval-ms", type=float, default=0.0, help="arrival interval (0: from --load)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--positions", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=0, help="vocab_size (0: the tiny BPE's own, 384)")
    # One thread by default: the dev box is shared, and with two intra-op threads on two busy cores a
    # step waits for the slower thread (measured: a batch-16 decode step 77 ms with 2 threads, 13.6 ms
    # with 1, under the same outside load).
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (0: torch's default)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument(
        "--networks", action="store_true", help="gpt2's network vs the generic path on the same requests"
    )
    parser.add_argument("--reps", type=int, default=2, help="--networks: runs of the workload per network")
    parser.add_argument("--device", default="cpu", help="--networks: cpu or cuda")
    return parser.parse_args()


def interval_for(prompts: Sequence[Prompt], load: float, costs: Sequence[StepCost]) -> float:
    """The arrival interval that offers ``load`` times the full-batch mixed decode rate."""
    return statistics.fmean(p.max_new_tokens for p in prompts) / (load * full_rate(costs))


def full_rate(costs: Sequence[StepCost]) -> float:
    """Decode tokens/s of a full batch with one long sequence among short ones: what a continuous batch
    of this workload (8-256 new tokens) looks like most of the time, so load 1 is about its capacity."""
    return costs[-1].batch / costs[-1].mixed_s


def describe_workload(
    prompts: Sequence[Prompt], arrivals: Sequence[Arrival], costs: Sequence[StepCost]
) -> None:
    new_tokens = sorted(p.max_new_tokens for p in prompts)
    prompt_tokens = [len(p.token_ids) for p in prompts]
    interval = arrivals[1].arrival_s if len(arrivals) > 1 else 0.0
    offered = statistics.fmean(new_tokens) / interval if interval else math.inf
    print(
        f"\nworkload: {len(prompts)} requests, prompts {min(prompt_tokens)}-{max(prompt_tokens)} tokens "
        f"(mean {statistics.fmean(prompt_tokens):.0f}), max_new_tokens log-uniform "
        f"{NEW_TOKENS[0]}-{NEW_TOKENS[1]} (median {statistics.median(new_tokens):.0f}, mean "
        f"{statistics.fmean(new_tokens):.0f}, max {new_tokens[-1]}), greedy; {sum(new_tokens)} tokens to "
        "generate"
    )
    print(
        f"arrivals: one every {interval * 1e3:.1f} ms (Δ), the last at {arrivals[-1].arrival_s:.2f} s; "
        f"offered {offered:.0f} tokens/s = {offered / full_rate(costs):.2f}x the batch-{costs[-1].batch} "
        "mixed decode rate"
    )


def main() -> None:
    args = parse_args()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    shape = ModelShape(args.layers, args.heads, args.width, args.positions, args.vocab)
    checkpoint = checkpoint_for(shape, args.seed)
    config = json.loads((checkpoint / "config.json").read_text())
    tokenizer_vocab = len(json.loads((checkpoint / "tokenizer.json").read_text())["model"]["vocab"])
    if args.networks:
        print(f"GPT-2, random weights (seed {args.seed}): {shape.describe(config['vocab_size'])}")
        print(f"{args.device}, torch threads {torch.get_num_threads()}; max running {args.max_batch}")
        compare_networks(args, checkpoint, tokenizer_vocab, config["eos_token_id"])
        return
    engine = load_engine(checkpoint, args.max_batch, "cpu")
    print(f"GPT-2, random weights (seed {args.seed}): {shape.describe(config['vocab_size'])}")
    print(
        f"checkpoint {checkpoint}; cpu, torch threads {torch.get_num_threads()} of {os.cpu_count()} cores; "
        f"max running batch {args.max_batch} for every policy; KV cache never short (no preemption)"
    )

    batches = sorted({1, *(b for b in (4, 8, 16) if b < args.max_batch), args.max_batch})
    costs = step_costs(engine, batches, tokenizer_vocab, rounds=1 if args.quick else 2)
    print_step_costs(costs)

    prompts = workload(
        args.requests or (40 if args.quick else 128), tokenizer_vocab, config["eos_token_id"], args.seed
    )
    interval = args.interval_ms / 1e3 if args.interval_ms else interval_for(prompts, args.load, costs)
    arrivals = steady(prompts, interval)
    describe_workload(prompts, arrivals, costs)
    runs = [
        measure_continuous(engine, arrivals),
        measure_static(engine, arrivals, args.max_batch, "static"),
        measure_static(engine, arrivals, 1, "one at a time"),
    ]
    fixed = measure_fixed(engine, arrivals, args.max_batch)
    generate = measure_generate(checkpoint, arrivals, args.max_batch)
    print_runs([*runs, fixed, generate], arrivals)
    print_ratios(runs[0], [runs[1], fixed, generate], arrivals)
    print_agreement([*runs, fixed], arrivals)
    same = sum(generate.tokens[a.key] == runs[0].tokens[a.key] for a in arrivals)
    print(f"transformers' generate over left-padded batches gave the same ids for {same}/{len(arrivals)}")


if __name__ == "__main__":
    main()
