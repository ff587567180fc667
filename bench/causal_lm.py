"""The generate kind against transformers on one workload, side by side (bench/README.md, "bench.causal_lm"):
``batchwork run`` all in and its engine driven directly vs transformers' continuous batching, ``generate``
over static batches and one at a time; a random Llama-shaped checkpoint, greedy. Tokens/s and ratios.
"""

from __future__ import annotations

import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from bench import harness as h
from tests.integration.tiny_gpt2 import _tokenizer
from tests.support.batched_runs import Request, run_continuous
from worker.models.registry import model_class
from worker.settings import Settings

PROMPT_TOKENS = (5, 200)
NEW_TOKENS = (8, 256)
PAGE = 16


def random_checkpoint(name: str, seed: int, make: Callable[[Any], Any]) -> Path:
    """``make(tokenizer)``'s model with the tests' tiny BPE, built once in the temp dir; its EOS head row is
    zero, so greedy decoding never ends by EOS and max_new_tokens sets every length."""

    def build(directory: Path) -> None:
        tokenizer = _tokenizer()
        tokenizer.save_pretrained(directory)
        torch.manual_seed(seed)
        model = make(tokenizer).eval()
        with torch.no_grad():
            model.get_output_embeddings().weight[tokenizer.eos_token_id].zero_()
        model.save_pretrained(directory)

    return h.cached_checkpoint(name, build)


def llama(layers: int, width: int, seed: int) -> Path:
    def make(tokenizer: Any) -> Any:
        eos = tokenizer.eos_token_id
        return LlamaForCausalLM(LlamaConfig(
            vocab_size=len(tokenizer), hidden_size=width, intermediate_size=width * 11 // 4,
            num_hidden_layers=layers, num_attention_heads=width // 64, num_key_value_heads=width // 64,
            max_position_embeddings=1024, initializer_range=0.1, bos_token_id=eos, eos_token_id=eos,
            pad_token_id=eos))  # fmt: skip

    return random_checkpoint(f"batchwork-bench-llama-{layers}x{width}-s{seed}", seed, make)


def draws(
    count: int, vocab: int, eos: int, seed: int, prompt_tokens: tuple[int, int]
) -> list[tuple[list, int]]:
    """Seeded prompts of random token ids (never EOS) and max_new_tokens log-uniform over NEW_TOKENS."""
    rng, tokens = random.Random(seed), [t for t in range(vocab) if t != eos]
    low, high = math.log(NEW_TOKENS[0]), math.log(NEW_TOKENS[1])
    return [(rng.choices(tokens, k=rng.randint(*prompt_tokens)), round(math.exp(rng.uniform(low, high))))
            for _ in range(count)]  # fmt: skip


def workload(checkpoint: Path, count: int, seed: int) -> tuple[list[str], list[list[int]], list[int]]:
    """Prompt texts (random ids decoded), their ids as the tokenizer gives them back, max_new_tokens."""
    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint), local_files_only=True)
    drawn = draws(count, len(tokenizer), tokenizer.eos_token_id, seed, PROMPT_TOKENS)
    texts = [tokenizer.decode(ids) for ids, _ in drawn]
    return texts, [tokenizer(text)["input_ids"] for text in texts], [new for _, new in drawn]


def run_embedded(checkpoint: Path, texts: list[str], new: list[int], options: dict, args: Any) -> tuple:
    """``batchwork run`` end to end (process start and model load included): seconds and tokens."""
    entry = f"generate:{checkpoint}"
    env = {**os.environ, "BATCHWORK_MODEL_OPTIONS": json.dumps({entry: options}), "HF_HUB_OFFLINE": "1",
           "BATCHWORK_DEVICE": args.device,
           "OMP_NUM_THREADS": str(args.threads or os.cpu_count())}  # fmt: skip
    command = [str(Path(sys.executable).parent / "batchwork"), "run", "in.jsonl", "-m", entry, "-o",
               "out.jsonl"]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="batchwork-bench-run-") as work:
        lines = [
            json.dumps({"prompt": t, "max_new_tokens": n}) + "\n" for t, n in zip(texts, new, strict=True)
        ]
        (Path(work) / "in.jsonl").write_text("".join(lines))
        started = time.monotonic()
        done = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, check=False)
        elapsed = time.monotonic() - started
        if done.returncode != 0:
            raise SystemExit(f"batchwork run failed ({done.returncode}): {done.stderr.strip()[-500:]}")
        rows = [json.loads(line) for line in (Path(work) / "out.jsonl").read_text().splitlines()]
    return elapsed, sum(row["output"]["tokens"] for row in rows if row.get("output"))


def run_engine(checkpoint: Path, texts: list[str], new: list[int], options: dict, args: Any) -> Workload:
    """Our engine driven directly (as the worker's engine drives it, no queue), after a warm-up."""
    entry = f"generate:{checkpoint}"
    settings = Settings(models=[entry], model_options={entry: options})
    model: Any = model_class(entry, settings)(settings)
    model.load(args.device)
    items = [model.validate(i, {"prompt": t, "max_new_tokens": n}, settings)
             for i, (t, n) in enumerate(zip(texts, new, strict=True))]  # fmt: skip
    prompts = [prepared.payload for prepared in model.prepare(items)]
    run_workload(model, prompts[:2])  # warm-up, untimed
    run = run_workload(model, prompts)
    print(f"  (engine: {model.preemptions} preemptions)")
    return run


@dataclass
class Workload:
    """One engine's continuous run of every request queued at once."""

    tokens_per_s: float
    wall_s: float
    cpu_s: float
    step_s: list[float]
    mean_batch: float
    ids: list[list[int]]

    def row(self, name: str) -> list[object]:
        return [name, self.tokens_per_s, f"{self.wall_s:.2f}", f"{self.cpu_s:.2f}", len(self.step_s),
                f"{statistics.fmean(self.step_s) * 1e3:.1f}", f"{self.mean_batch:.1f}"]  # fmt: skip


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
    for flag, default in (("requests", 64), ("layers", 8), ("width", 512), ("running", 16), ("threads", 1)):
        parser.add_argument(f"--{flag}", type=int, default=default)  # threads 0: torch's default
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--skip-one-at-a-time", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    checkpoint = llama(args.layers, args.width, args.seed)
    texts, ids, new = workload(checkpoint, args.requests, args.seed)
    # The KV budget: every running sequence's worst case, so neither side preempts or waits for cache.
    budget = args.running * (-(-(PROMPT_TOKENS[1] + 2 * NEW_TOKENS[1]) // PAGE) * PAGE)
    options = {"kv_budget_tokens": budget, "max_running": args.running, "precision": args.precision}
    print(f"Llama-shaped random model: {args.layers} layers, hidden {args.width}, {args.width // 64} heads; "
          f"{args.device} {args.precision}, torch threads {torch.get_num_threads()}; {len(ids)} requests, "
          f"prompts {min(map(len, ids))}-{max(map(len, ids))} tokens, max_new_tokens {min(new)}-{max(new)} "
          f"(sum {sum(new)}); greedy; {args.running} sequences a step, KV budget {budget} tokens "
          f"(pages of {PAGE})")  # fmt: skip
    rate: dict[str, float] = {}

    def report(name: str, seconds: float, tokens: int) -> None:
        rate[name] = tokens / seconds
        print(
            f"{name:>34}: {tokens:6d} tokens in {seconds:7.2f} s = {tokens / seconds:8.1f} tokens/s",
            flush=True,
        )

    RUN, ENGINE = "batchwork run (embedded, all in)", "batchwork engine"
    CB, ONE = "transformers continuous batching", "generate, one at a time"
    report(RUN, *run_embedded(checkpoint, texts, new, options, args))
    ours = (engine := run_engine(checkpoint, texts, new, options, args)).ids
    report(ENGINE, engine.wall_s, sum(map(len, ours)))
    seconds, theirs = run_transformers_cb(load_reference(checkpoint, args), ids, new, budget, args.running)
    report(CB, seconds, sum(map(len, theirs)))
    model = load_reference(checkpoint, args)  # a live manager breaks later ordinary forwards (#48735)
    seconds, static = run_generate(model, ids, new, args.running)
    report(STATIC := f"generate, static batches of {args.running}", seconds, sum(map(len, static)))
    if not args.skip_one_at_a_time:
        seconds, single = run_generate(model, ids, new, 1)
        report(ONE, seconds, sum(map(len, single)))
        equal = [sum(a == b for a, b in zip(got, single, strict=True)) for got in (ours, theirs)]
        print(f"greedy ids equal to generate one at a time: ours {equal[0]}/{len(ids)}, "
              f"transformers CB {equal[1]}/{len(ids)}")  # fmt: skip
    print(f"\nembedded run / transformers CB: {rate[RUN] / rate[CB]:.2f}x (target >= 1.0x); "
          f"engine alone {rate[ENGINE] / rate[CB]:.2f}x")  # fmt: skip
    if ONE in rate:
        print(f"embedded run / generate one at a time: {rate[RUN] / rate[ONE]:.2f}x (target >= 5x)")
    print(f"embedded run / generate static batches: {rate[RUN] / rate[STATIC]:.2f}x (target >= 2x); "
          f"engine alone {rate[ENGINE] / rate[STATIC]:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
