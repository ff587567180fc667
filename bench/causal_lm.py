"""The generate kind against transformers on one workload, side by side (bench/README.md, "bench.causal_lm"):
``batchwork run`` all in and its engine driven directly vs transformers' continuous batching, ``generate``
over static batches and one at a time; a random Llama- or GPT-2-shaped checkpoint, greedy. With
``--architecture gpt2`` the ``gpt2`` system is our own GPT-2 network under the same engine (``--systems``).
"""

from __future__ import annotations

import json
import math
import os
import random
import statistics
import tempfile
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from bench import harness as h
from tests.integration.tiny_gpt2 import _tokenizer
from tests.support.batched_runs import Request, run_continuous
from tests.support.processes import batchwork_command
from worker.models.registry import model_class
from worker.settings import Settings

PROMPT_TOKENS = (5, 200)
NEW_TOKENS = (8, 256)
PAGE = 16
SYSTEMS = {"run": "batchwork run (embedded, all in)", "engine": "batchwork engine",
           "gpt2": "batchwork engine, gpt2 network", "cb": "transformers continuous batching",
           "static": "generate, static batches", "one": "generate, one at a time"}  # fmt: skip


def checkpoint(architecture: str, layers: int, width: int, vocab: int, seed: int) -> Path:
    """A random model of ``architecture`` with the tests' tiny BPE, built once in the temp dir; its EOS head
    row is zero, so greedy decoding never ends by EOS and max_new_tokens sets every length."""

    def build(directory: Path) -> None:
        tokenizer = _tokenizer()
        tokenizer.save_pretrained(directory)
        eos = tokenizer.eos_token_id
        config = AutoConfig.for_model(
            architecture, vocab_size=max(vocab, len(tokenizer)), hidden_size=width,
            intermediate_size=width * 11 // 4, num_hidden_layers=layers, num_attention_heads=width // 64,
            num_key_value_heads=width // 64, max_position_embeddings=1024, initializer_range=0.1,
            bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)  # fmt: skip
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config).eval()
        with torch.no_grad():
            model.get_output_embeddings().weight[eos].zero_()
        model.save_pretrained(directory)

    return h.cached_checkpoint(f"batchwork-bench-{architecture}-{layers}x{width}-v{vocab}-s{seed}", build)


def workload(directory: Path, count: int, seed: int) -> tuple[list[str], list[list[int]], list[int]]:
    """Seeded prompts of random token ids (never EOS) decoded to text, their ids as the tokenizer gives them
    back, and max_new_tokens log-uniform over NEW_TOKENS."""
    tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    rng, tokens = random.Random(seed), [t for t in range(len(tokenizer)) if t != tokenizer.eos_token_id]
    low, high = math.log(NEW_TOKENS[0]), math.log(NEW_TOKENS[1])
    texts, new = list[str](), list[int]()
    for _ in range(count):
        texts.append(tokenizer.decode(rng.choices(tokens, k=rng.randint(*PROMPT_TOKENS))))
        new.append(round(math.exp(rng.uniform(low, high))))
    return texts, [tokenizer(text)["input_ids"] for text in texts], new


def run_embedded(directory: Path, texts: list[str], new: list[int], options: dict, args: Any) -> tuple:
    """``batchwork run`` end to end (process start and model load included): seconds and tokens."""
    entry = f"generate:{directory}"
    env = {**os.environ, "BATCHWORK_MODEL_OPTIONS": json.dumps({entry: options}), "HF_HUB_OFFLINE": "1",
           "BATCHWORK_DEVICE": args.device,
           "OMP_NUM_THREADS": str(args.threads or os.cpu_count())}  # fmt: skip
    command = batchwork_command("run", "in.jsonl", "-m", entry, "-o", "out.jsonl")
    with tempfile.TemporaryDirectory(prefix="batchwork-bench-run-") as work:
        lines = [
            json.dumps({"prompt": t, "max_new_tokens": n}) + "\n" for t, n in zip(texts, new, strict=True)
        ]
        (Path(work) / "in.jsonl").write_text("".join(lines))
        ran = h.whole_run(command, env, Path(work))
        if ran.returncode != 0:
            raise SystemExit(f"batchwork run failed ({ran.returncode}): {ran.stderr.strip()[-500:]}")
        rows = [json.loads(line) for line in (Path(work) / "out.jsonl").read_text().splitlines()]
    return ran.wall_s, sum(row["output"]["tokens"] for row in rows if row.get("output"))


def run_engines(
    systems: Sequence[str], directory: Path, texts: list[str], new: list[int], options: dict, args: Any
) -> dict[str, Workload]:
    """Our engine driven directly (as the worker drives it, no queue): the generate kind over the checkpoint
    (``engine``) and the gpt2 kind's own network over it (``gpt2``), each warmed up, then ``args.reps`` runs
    in turn (a burst of outside load hits one run of each); the fastest run, with the least CPU seconds."""
    engines, best = {}, dict[str, Workload]()
    for system in systems:
        entry = f"generate:{directory}" if system == "engine" else "gpt2"
        block = options if system == "engine" else options | {"path": str(directory)}
        settings = Settings(models=[entry], model_options={entry: block})
        model: Any = model_class(entry, settings)(settings)
        model.load(args.device)
        items = [model.validate(i, {"prompt": t, "max_new_tokens": n}, settings)
                 for i, (t, n) in enumerate(zip(texts, new, strict=True))]  # fmt: skip
        engines[system] = model, [prepared.payload for prepared in model.prepare(items)]
        run_workload(model, engines[system][1][:2])  # warm-up, untimed
    for _ in range(args.reps):
        for system, (model, prompts) in engines.items():
            run = run_workload(model, prompts)
            if system in best:
                run.cpu_s = min(run.cpu_s, best[system].cpu_s)
            if system not in best or run.tokens_per_s > best[system].tokens_per_s:
                best[system] = run
    for system, (model, _) in engines.items():
        run = best[system]
        print(f"  ({SYSTEMS[system]}: CPU {run.cpu_s:.2f} s, {len(run.step_s)} steps of "
              f"{statistics.fmean(run.step_s) * 1e3:.1f} ms, mean batch {run.mean_batch:.1f}, "
              f"{model.preemptions} preemptions)")  # fmt: skip
    return best


@dataclass
class Workload:
    """One engine's continuous run of every request queued at once."""

    tokens_per_s: float
    wall_s: float
    cpu_s: float
    step_s: list[float]
    mean_batch: float
    ids: list[list[int]]


def run_workload(engine: Any, prompts: Sequence[Any]) -> Workload:
    """A generate-kind engine (``CausalLM``) stepped through ``prompts`` (``Prompt``s), all queued at once."""
    step_s, batch_sizes, ids = list[float](), list[int](), dict[Hashable, tuple[int, ...]]()

    class Recorded:
        max_running = engine.max_running
        can_admit, admit, running = engine.can_admit, engine.admit, engine.running

        def step(self) -> list[Any]:
            batch_sizes.append(engine.running())
            before = time.monotonic()
            done = engine.advance()
            step_s.append(time.monotonic() - before)
            ids.update((g.key, g.token_ids) for g in done)
            return done

    wall, cpu = time.monotonic(), time.process_time()
    run_continuous(Recorded(), [Request(i, p, p.kv_tokens) for i, p in enumerate(prompts)])
    wall, cpu = time.monotonic() - wall, time.process_time() - cpu
    return Workload(sum(map(len, ids.values())) / wall, wall, cpu, step_s, statistics.fmean(batch_sizes),
                    [list(ids[i]) for i in range(len(prompts))])  # fmt: skip


def load_reference(checkpoint: Path, args: Any) -> Any:
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.precision, torch.float32)
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), local_files_only=True, dtype=dtype,
                                                 attn_implementation="sdpa")  # fmt: skip
    return model.to(args.device).eval()


def run_transformers_cb(model: Any, ids: list[list[int]], new: list[int], budget: int, running: int) -> tuple:
    """transformers' continuous batching: the manager generate_batch uses, each request its own limit."""
    eos = model.config.eos_token_id
    config = GenerationConfig(do_sample=False, max_new_tokens=max(new), eos_token_id=eos, pad_token_id=eos)
    cb = ContinuousBatchingConfig(page_size=PAGE, num_blocks=budget // PAGE, max_requests_per_batch=running,
                                  max_batch_tokens=max(len(i) for i in ids) + running,
                                  allow_block_sharing=False, use_cuda_graph=False)  # fmt: skip
    # Warm-up with the same config, untimed.
    model.generate_batch([ids[0]], generation_config=config, continuous_batching_config=cb, max_new_tokens=4)
    started = time.monotonic()
    manager = model.init_continuous_batching(generation_config=config, continuous_batching_config=cb)
    manager.start()
    for i, (prompt, n) in enumerate(zip(ids, new, strict=True)):
        manager.add_request(prompt, request_id=str(i), max_new_tokens=n)
    results: dict[str, Any] = {}
    while len(results) < len(ids):
        result = manager.get_result(timeout=1)
        if result is not None and result.is_finished():
            results[result.request_id] = result
        elif result is None and not manager.is_running():
            raise SystemExit("transformers' continuous batching stopped early")
    manager.stop(block=True)
    return time.monotonic() - started, [list(results[str(i)].generated_tokens) for i in range(len(ids))]


def run_generate(
    model: Any, ids: list[list[int]], new: list[int], batch: int
) -> tuple[float, list[list[int]]]:
    """``generate`` over batches of ``batch`` in order, left-padded, each run to its longest max_new_tokens;
    each request keeps its own first max_new_tokens. batch=1: one request at a time."""
    pad, out, started = model.config.eos_token_id, list[list[int]](), time.monotonic()
    with torch.inference_mode():
        for start in range(0, len(ids), batch):
            prompts, limits = ids[start : start + batch], new[start : start + batch]
            longest, steps = max(map(len, prompts)), max(limits)
            rows = torch.tensor([[pad] * (longest - len(p)) + p for p in prompts], device=model.device)
            mask = torch.tensor(
                [[0] * (longest - len(p)) + [1] * len(p) for p in prompts], device=model.device
            )
            generated = model.generate(rows, attention_mask=mask, do_sample=False, max_new_tokens=steps,
                                       min_new_tokens=steps, pad_token_id=pad)  # fmt: skip
            out += [row[longest:][:n].tolist() for row, n in zip(generated, limits, strict=True)]
    return time.monotonic() - started, out


def main() -> None:
    parser = h.arguments(__doc__, seed=7)
    for flag, default in (("requests", 64), ("layers", 8), ("width", 512), ("vocab", 0), ("running", 16),
                          ("threads", 1), ("reps", 1)):  # fmt: skip
        parser.add_argument(f"--{flag}", type=int, default=default)  # threads 0: torch's; vocab 0: the BPE's
    parser.add_argument("--architecture", default="llama", help="llama, gpt2 or another transformers one")
    parser.add_argument("--systems", default="run,engine,cb,static,one", help=f"of {','.join(SYSTEMS)}")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", default="fp32")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    systems = [s for s in SYSTEMS if s in args.systems.split(",")]
    if unknown := set(args.systems.split(",")) - set(SYSTEMS):
        parser.error(f"--systems: unknown {', '.join(sorted(unknown))} (known: {', '.join(SYSTEMS)})")
    directory = checkpoint(args.architecture, args.layers, args.width, args.vocab, args.seed)
    texts, ids, new = workload(directory, args.requests, args.seed)
    # The KV budget: every running sequence's worst case, so neither side preempts or waits for cache.
    budget = args.running * (-(-(PROMPT_TOKENS[1] + 2 * NEW_TOKENS[1]) // PAGE) * PAGE)
    options = {"kv_budget_tokens": budget, "max_running": args.running, "precision": args.precision}
    h.header("bench.causal_lm", args)
    print(f"{args.architecture}-shaped random model: {args.layers} layers, hidden {args.width}, "
          f"{args.width // 64} heads; {args.device} {args.precision}, torch threads "
          f"{torch.get_num_threads()}; {len(ids)} requests, prompts {min(map(len, ids))}-"
          f"{max(map(len, ids))} tokens, max_new_tokens {min(new)}-{max(new)} (sum {sum(new)}); greedy; "
          f"{args.running} sequences a step, KV budget {budget} tokens (pages of {PAGE})")  # fmt: skip
    timed: dict[str, tuple[float, int]] = {}  # each system's seconds and tokens
    ids_of: dict[str, list[list[int]]] = {}  # and its greedy ids (batchwork run's output has none)
    if "run" in systems:
        timed["run"] = run_embedded(directory, texts, new, options, args)
    ours = [s for s in systems if s in ("engine", "gpt2")]
    for system, run in run_engines(ours, directory, texts, new, options, args).items():
        timed[system], ids_of[system] = (run.wall_s, sum(map(len, run.ids))), run.ids
    references = [("cb", 0), ("static", args.running), ("one", 1)]
    for system, batch in [(system, batch) for system, batch in references if system in systems]:
        # A fresh model each: a live continuous batching manager breaks later forwards (#48735).
        model = load_reference(directory, args)
        if system == "cb":
            seconds, ids_of[system] = run_transformers_cb(model, ids, new, budget, args.running)
        else:
            seconds, ids_of[system] = run_generate(model, ids, new, batch)
        timed[system] = seconds, sum(map(len, ids_of[system]))
    compare(timed, ids_of, args.running)


def compare(timed: dict[str, tuple[float, int]], ids_of: dict[str, list[list[int]]], running: int) -> None:
    """Each system's tokens/s, its greedy ids against generate one at a time, and the ratios."""
    rate = {system: tokens / seconds for system, (seconds, tokens) in timed.items()}
    for system, (seconds, tokens) in timed.items():
        name = SYSTEMS[system] + (f" of {running}" if system == "static" else "")
        print(f"{name:>34}: {tokens:6d} tokens in {seconds:7.2f} s = {rate[system]:8.1f} tokens/s")
    for system, other in (("engine", "one"), ("gpt2", "one"), ("cb", "one"), ("engine", "gpt2")):
        if system in ids_of and other in ids_of:
            equal = sum(a == b for a, b in zip(ids_of[system], ids_of[other], strict=True))
            print(f"greedy ids, {SYSTEMS[system]} = {SYSTEMS[other]}: {equal}/{len(ids_of[other])}")
    pairs = (("run", "cb", ">= 1.0x"), ("engine", "cb", ""), ("run", "one", ">= 5x"),
             ("run", "static", ">= 2x"), ("engine", "static", ""), ("gpt2", "engine", ""))  # fmt: skip
    for ours, theirs, target in pairs:
        if ours in rate and theirs in rate:
            aim = f" (target {target})" if target else ""
            print(f"{SYSTEMS[ours]} / {SYSTEMS[theirs]}: {h.ratio(rate[ours], rate[theirs])}{aim}")


if __name__ == "__main__":
    main()
