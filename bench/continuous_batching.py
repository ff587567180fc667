"""gpt2's own network vs the generic path (``generate:`` over the same directory) on one random GPT-2
checkpoint, same engine, options and requests: decode step costs, the whole workload continuously batched,
and both against transformers' greedy ``generate`` (bench/README.md, "bench.continuous_batching").
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from bench import harness as h
from bench.causal_lm import NEW_TOKENS, Workload, draws, random_checkpoint, run_generate, run_workload
from tests.integration.tiny_gpt2 import INITIALIZER_RANGE
from worker.batching.sequences import pages_for
from worker.models.causal_lm.inputs import Prompt
from worker.models.causal_lm.model import PAGE_TOKENS, CausalLM
from worker.models.gpt2 import GPT2
from worker.models.registry import parse_model_entry, spec_class
from worker.settings import Settings

PROMPT_TOKENS = (5, 40)
# Step costs decode from prompts as long as the workload's mean prompt (short), and as long as its longest
# requests grow (long); mixed is one long among short ones.
SHORT, LONG, PROBE_STEPS = 22, 256, 32
KINDS = ("short", "long", "mixed", "prefill")


def gpt2(a: argparse.Namespace) -> Path:
    def make(tokenizer: Any) -> Any:
        eos = tokenizer.eos_token_id
        return GPT2LMHeadModel(GPT2Config(n_layer=a.layers, n_head=a.heads, n_embd=a.width,
                                          n_positions=a.positions, vocab_size=max(a.vocab, len(tokenizer)),
                                          bos_token_id=eos, eos_token_id=eos,
                                          initializer_range=INITIALIZER_RANGE))  # fmt: skip

    shape = f"{a.layers}x{a.heads}x{a.width}x{a.positions}-v{a.vocab}-s{a.seed}"
    return random_checkpoint(f"batchwork-bench-gpt2-{shape}", a.seed, make)


def load_engine(checkpoint: Path, args: argparse.Namespace, generic: bool) -> CausalLM:
    """gpt2 (its own network), or with ``generic`` the generate kind over the same directory; the KV budget
    holds every running sequence's worst case, so only ``--max-batch`` limits a step."""
    budget = args.max_batch * pages_for(PROMPT_TOKENS[1] + NEW_TOKENS[1], PAGE_TOKENS) * PAGE_TOKENS
    options = {"kv_budget_tokens": budget, "max_running": args.max_batch}
    if generic:
        spec = parse_model_entry(f"generate:{checkpoint}")
        cls, settings = spec_class(spec), Settings(model_options={spec.name: options})
    else:
        cls, settings = GPT2, Settings(model_options={"gpt2": options | {"path": str(checkpoint)}})
    engine = cls(settings)
    assert isinstance(engine, CausalLM)
    engine.load(args.device)
    return engine


def probe(engine: CausalLM, lengths: Sequence[int], vocab: int, rng: random.Random) -> tuple[float, float]:
    """Prefill time of prompts of these lengths together, and the median of the PROBE_STEPS decode steps."""
    for key, length in enumerate(lengths):
        prompt = tuple(rng.randrange(1, vocab) for _ in range(length))
        engine.admit(("probe", key), Prompt(prompt, PROBE_STEPS + 1))
    steps = []
    while engine.running():
        before = time.monotonic()
        engine.advance()
        steps.append(time.monotonic() - before)
    return steps[0], statistics.median(steps[1:])


def step_costs(engines: dict[str, CausalLM], batches: Sequence[int], vocab: int, rounds: int) -> dict:
    """{(engine, batch, kind): seconds}, each the least of ``rounds`` taken in turn, so a burst of outside
    load hits one round of each engine rather than every round of one."""
    rng, best = random.Random(0), dict[tuple[str, int, str], float]()
    for engine in engines.values():  # untimed: the process's first kernels (allocator, oneDNN) warm up
        probe(engine, [SHORT], vocab, rng)
    for _ in range(rounds):
        for name, engine in engines.items():
            for batch in batches:
                short = [SHORT] * batch
                prefill, decode = probe(engine, short, vocab, rng)
                figures = {"short": decode, "long": probe(engine, [LONG] * batch, vocab, rng)[1]}
                figures["prefill"] = prefill
                if batch > 1:
                    figures["mixed"] = probe(engine, [LONG, *short[1:]], vocab, rng)[1]
                for kind, seconds in figures.items():
                    best[name, batch, kind] = min(best.get((name, batch, kind), math.inf), seconds)
    return best


def main() -> None:
    p = h.arguments(__doc__, quick="one probe round, 24 requests", seed=7)
    p.add_argument("--networks", action="store_true", help="the only study left (kept for old commands)")
    p.add_argument("--requests", type=int, default=0, help="requests (0: 64, or 24 with --quick)")
    p.add_argument("--max-batch", type=int, default=16, help="most running sequences")
    p.add_argument("--reps", type=int, default=2, help="runs of the workload per network, in turn")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    for flag, default in (("layers", 4), ("heads", 4), ("width", 256), ("positions", 512), ("vocab", 0)):
        p.add_argument(f"--{flag}", type=int, default=default)  # vocab 0: the tiny BPE's own (384)
    # One thread by default: with two intra-op threads on two busy cores a step waits for the slower one.
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (0: torch's default)")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    checkpoint = gpt2(a)
    config = json.loads((checkpoint / "config.json").read_text())
    vocab = len(json.loads((checkpoint / "tokenizer.json").read_text())["model"]["vocab"])
    h.header("bench.continuous_batching", a)
    print(f"GPT-2, random weights: n_layer={a.layers} n_head={a.heads} n_embd={a.width} n_positions="
          f"{a.positions} vocab_size={config['vocab_size']}; {a.device}, "
          f"threads {torch.get_num_threads()}")  # fmt: skip
    engines = {"gpt2 network": load_engine(checkpoint, a, False), "generic": load_engine(checkpoint, a, True)}
    batches = sorted({1, a.max_batch})
    costs = step_costs(engines, batches, vocab, rounds=1 if a.quick else 2)
    print(f"\ndecode step ms (median of {PROBE_STEPS} steps, best of rounds in turn) from {SHORT}-token"
          f" prompts (short), {LONG}-token ones (long), one long among short (mixed); prefill: short"
          " prompts")  # fmt: skip
    ms = {key: f"{seconds * 1e3:.2f}" for key, seconds in costs.items()}
    rows = [[n, b, *(ms.get((n, b, k), "-") for k in KINDS)] for n in engines for b in batches]
    h.print_table(["network", "batch", *KINDS], rows)
    for b in batches:
        shown = [f"{k} {h.ratio(costs['generic', b, k], costs['gpt2 network', b, k])}"
                 for k in KINDS if (b, k) != (1, "mixed")]  # fmt: skip
        print(f"generic / gpt2 network step time at batch {b}: {', '.join(shown)}")
    count = a.requests or (24 if a.quick else 64)
    drawn = draws(count, vocab, config["eos_token_id"], a.seed, PROMPT_TOKENS)
    prompts = [Prompt(tuple(ids), new) for ids, new in drawn]
    compare_workload(engines, prompts, a.reps, reference_ids(checkpoint, a.device, prompts))


def compare_workload(
    engines: dict[str, CausalLM], prompts: Sequence[Prompt], reps: int, reference: list[list[int]]
) -> None:
    """The best of ``reps`` runs in turn per network (CPU seconds: the least); ids against ``reference``."""
    new, lengths = [p.max_new_tokens for p in prompts], [len(p.token_ids) for p in prompts]
    print(f"\nworkload: {len(prompts)} requests queued at once, prompts {min(lengths)}-{max(lengths)} tokens,"
          f" max_new_tokens {min(new)}-{max(new)} (sum {sum(new)}), greedy, continuous; best of {reps}"
          " runs")  # fmt: skip
    runs: dict[str, Workload] = {}
    for _ in range(reps):
        for name, engine in engines.items():
            run = run_workload(engine, prompts)
            if name in runs:
                run.cpu_s = min(run.cpu_s, runs[name].cpu_s)
            if name not in runs or run.tokens_per_s > runs[name].tokens_per_s:
                runs[name] = run
    columns = ["network", "tokens/s", "wall s", "CPU s", "steps", "step ms", "mean batch"]
    h.print_table(columns, [run.row(name) for name, run in runs.items()])
    ours, generic = runs["gpt2 network"], runs["generic"]
    print(f"gpt2 network / generic: tokens/s {h.ratio(ours.tokens_per_s, generic.tokens_per_s)}, "
          f"CPU seconds {h.ratio(generic.cpu_s, ours.cpu_s)}")  # fmt: skip
    for name, run in runs.items():
        pairs = enumerate(zip(run.ids, reference, strict=True))
        differing = [f"request {i} from token {first_difference(got, want)} of {len(want)}"
                     for i, (got, want) in pairs if got != want]  # fmt: skip
        print(f"{name}: greedy ids equal transformers' generate(do_sample=False) for "
              f"{len(prompts) - len(differing)}/{len(prompts)}",
              *(["(differ:", ", ".join(differing) + ")"] * bool(differing)))  # fmt: skip
    same = sum(x == y for x, y in zip(ours.ids, generic.ids, strict=True))
    print(f"gpt2 network and generic give the same ids for {same}/{len(prompts)}")


def reference_ids(checkpoint: Path, device: str, prompts: Sequence[Prompt]) -> list[list[int]]:
    """transformers' greedy ``generate``, one request at a time (bench.causal_lm's reference)."""
    model = GPT2LMHeadModel.from_pretrained(str(checkpoint), local_files_only=True).to(device).eval()
    _, ids = run_generate(model, [list(p.token_ids) for p in prompts], [p.max_new_tokens for p in prompts], 1)
    return ids


def first_difference(ours: Sequence[int], theirs: Sequence[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), len(ours))


if __name__ == "__main__":
    main()
