"""The generate kind against transformers on one workload, side by side in one run: batchwork's embedded run
(``batchwork run --model generate:/dir``) and its engine driven directly, transformers' own continuous
batching (the ContinuousBatchingManager behind ``generate_batch``, one request per add_request so each keeps
its max_new_tokens, an explicit ContinuousBatchingConfig sized for the same KV budget), ``generate`` one
request at a time, and ``generate`` over fixed static batches (left-padded, each run to its longest).

The model is a random Llama-shaped checkpoint built in the temp dir (reused by later runs); greedy; EOS is
never chosen (its head row is zero), so max_new_tokens sets every length. It prints tokens/s and the ratios,
never asserts and never downloads. Run from the repository root:
``python -m bench.causal_lm [--requests 64] [--device cpu|cuda] [--precision fp32|bf16]``.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import harness as h

PROMPT_TOKENS = (5, 200)
NEW_TOKENS = (8, 256)
PAGE = 16


def checkpoint_for(layers: int, width: int, seed: int) -> Path:
    name = f"batchwork-bench-llama-{layers}x{width}-s{seed}"
    return h.cached_checkpoint(name, lambda d: build_checkpoint(d, layers, width, seed))


def build_checkpoint(directory: Path, layers: int, width: int, seed: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.integration.tiny_gpt2 import _tokenizer

    tokenizer = _tokenizer()
    tokenizer.save_pretrained(directory)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=width,
        intermediate_size=width * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=width // 64,
        num_key_value_heads=width // 64,
        max_position_embeddings=1024,
        initializer_range=0.1,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight[tokenizer.eos_token_id].zero_()
    model.save_pretrained(directory)


def workload(checkpoint: Path, count: int, seed: int) -> tuple[list[str], list[list[int]], list[int]]:
    """Prompt texts (random token ids decoded), their token ids as the tokenizer gives them back, and
    max_new_tokens log-uniform over 8-256."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint), local_files_only=True)
    rng = random.Random(seed)
    vocab = [t for t in range(len(tokenizer)) if t != tokenizer.eos_token_id]
    texts, ids, new = [], [], []
    low, high = math.log(NEW_TOKENS[0]), math.log(NEW_TOKENS[1])
    for _ in range(count):
        text = tokenizer.decode(rng.choices(vocab, k=rng.randint(*PROMPT_TOKENS)))
        texts.append(text)
        ids.append(tokenizer(text)["input_ids"])
        new.append(round(math.exp(rng.uniform(low, high))))
    return texts, ids, new


def run_embedded(
    checkpoint: Path, texts: list[str], new: list[int], budget: int, running: int, args: Any
) -> tuple[float, int]:
    """``batchwork run`` end to end (process start and model load included): seconds and tokens."""
    work = Path(tempfile.mkdtemp(prefix="batchwork-bench-run-"))
    (work / "in.jsonl").write_text(
        "".join(
            json.dumps({"prompt": t, "max_new_tokens": n}) + "\n" for t, n in zip(texts, new, strict=True)
        )
    )
    entry = f"generate:{checkpoint}"
    options = {entry: {"kv_budget_tokens": budget, "max_running": running, "precision": args.precision}}
    env = {
        **os.environ,
        "BATCHWORK_MODEL_OPTIONS": json.dumps(options),
        "BATCHWORK_DEVICE": args.device,
        "OMP_NUM_THREADS": str(args.threads or os.cpu_count()),
        "HF_HUB_OFFLINE": "1",
    }
    command = [
        str(Path(sys.executable).parent / "batchwork"),
        "run",
        "in.jsonl",
        "--model",
        entry,
        "-o",
        "out.jsonl",
    ]
    started = time.monotonic()
    done = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, check=False)
    elapsed = time.monotonic() - started
    if done.returncode != 0:
        raise SystemExit(f"batchwork run failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    rows = [json.loads(line) for line in (work / "out.jsonl").read_text().splitlines()]
    shutil.rmtree(work, ignore_errors=True)
    return elapsed, sum(row["output"]["tokens"] for row in rows if row.get("output"))


def run_engine(
    checkpoint: Path, texts: list[str], new: list[int], budget: int, running: int, args: Any
) -> tuple[float, list[list[int]]]:
    """Our engine driven directly (as the worker's engine drives it, no queue): seconds and token ids."""
    from tests.support.batched_runs import Request, run_continuous
    from worker.models.registry import model_class
    from worker.settings import Settings

    entry = f"generate:{checkpoint}"
    options = {entry: {"kv_budget_tokens": budget, "max_running": running, "precision": args.precision}}
    settings = Settings(models=[entry], model_options=options)
    model: Any = model_class(entry, settings)(settings)
    model.load(args.device)
    checked = [
        model.validate(i, {"prompt": t, "max_new_tokens": n}, settings)
        for i, (t, n) in enumerate(zip(texts, new, strict=True))
    ]
    prepared = model.prepare(checked)
    requests = [Request(i, p.payload, p.length) for i, p in enumerate(prepared)]
    run_continuous(model, requests[:2])  # warm-up, untimed
    ids: dict[int, list[int]] = {}

    class Recorder:
        max_running = model.max_running

        def can_admit(self, length: int) -> bool:
            return bool(model.can_admit(length))

        def admit(self, key: Any, payload: Any) -> None:
            model.admit(key, payload)

        def running(self) -> int:
            return int(model.running())

        def step(self) -> list[Any]:
            done = model.advance()
            ids.update((g.key, list(g.token_ids)) for g in done)
            return done

    started = time.monotonic()
    run_continuous(Recorder(), requests)
    elapsed = time.monotonic() - started
    print(f"  (engine: {model.preemptions} preemptions)")
    return elapsed, [ids[i] for i in range(len(texts))]


def load_reference(checkpoint: Path, args: Any, attention: str = "sdpa") -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    dtype = (
        torch.bfloat16
        if args.precision == "bf16"
        else torch.float16
        if args.precision == "fp16"
        else torch.float32
    )
    return (
        AutoModelForCausalLM.from_pretrained(
            str(checkpoint), local_files_only=True, dtype=dtype, attn_implementation=attention
        )
        .to(args.device)
        .eval()
    )


def run_transformers_cb(
    model: Any, ids: list[list[int]], new: list[int], budget: int, running: int
) -> tuple[float, list[list[int]]]:
    """transformers' continuous batching: the manager generate_batch uses, each request its own limit."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=max(new),
        eos_token_id=model.config.eos_token_id,
        pad_token_id=model.config.eos_token_id,
    )
    cb = ContinuousBatchingConfig(
        page_size=PAGE,
        num_blocks=budget // PAGE,
        max_batch_tokens=max(len(i) for i in ids) + running,
        max_requests_per_batch=running,
        allow_block_sharing=False,
        use_cuda_graph=False,
    )
    # Warm-up with the same config, untimed.
    model.generate_batch([ids[0]], generation_config=config, continuous_batching_config=cb, max_new_tokens=4)
    started = time.monotonic()
    manager = model.init_continuous_batching(generation_config=config, continuous_batching_config=cb)
    manager.start()
    keys = [
        manager.add_request(prompt, request_id=str(i), max_new_tokens=n)
        for i, (prompt, n) in enumerate(zip(ids, new, strict=True))
    ]
    results: dict[str, Any] = {}
    while len(results) < len(keys):
        result = manager.get_result(timeout=1)
        if result is not None and result.is_finished():
            results[result.request_id] = result
        elif result is None and not manager.is_running():
            raise SystemExit("transformers' continuous batching stopped early")
    manager.stop(block=True)
    elapsed = time.monotonic() - started
    return elapsed, [list(results[str(i)].generated_tokens) for i in range(len(ids))]


def run_generate(
    model: Any, ids: list[list[int]], new: list[int], batch: int
) -> tuple[float, list[list[int]]]:
    """``generate`` over batches of ``batch`` in order, left-padded, each run to its longest max_new_tokens;
    each request keeps its own first max_new_tokens. batch=1: one request at a time."""
    import torch

    pad = model.config.eos_token_id
    out: list[list[int]] = []
    started = time.monotonic()
    with torch.inference_mode():
        for start in range(0, len(ids), batch):
            prompts, limits = ids[start : start + batch], new[start : start + batch]
            longest = max(map(len, prompts))
            rows = torch.tensor([[pad] * (longest - len(p)) + p for p in prompts], device=model.device)
            mask = torch.tensor(
                [[0] * (longest - len(p)) + [1] * len(p) for p in prompts], device=model.device
            )
            steps = max(limits)
            generated = model.generate(
                rows,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=steps,
                min_new_tokens=steps,
                pad_token_id=pad,
            )
            out += [row[longest:][:n].tolist() for row, n in zip(generated, limits, strict=True)]
    return time.monotonic() - started, out


def main() -> None:
    parser = h.arguments(__doc__, seed=7)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--running", type=int, default=16, help="sequences in a step, every batched policy")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads on the CPU (0: torch's default)"
    )
    parser.add_argument("--skip-one-at-a-time", action="store_true")
    args = parser.parse_args()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    checkpoint = checkpoint_for(args.layers, args.width, args.seed)
    texts, ids, new = workload(checkpoint, args.requests, args.seed)
    # The KV budget: every running sequence's worst case, so neither side preempts or waits for cache.
    budget = args.running * (-(-(PROMPT_TOKENS[1] + 2 * NEW_TOKENS[1]) // PAGE) * PAGE)
    total = sum(new)
    print(
        f"Llama-shaped random model: {args.layers} layers, hidden {args.width}, {args.width // 64} heads; "
        f"{args.device} {args.precision}, torch threads {torch.get_num_threads()}; {len(ids)} requests, "
        f"prompts {min(map(len, ids))}-{max(map(len, ids))} tokens, max_new_tokens {min(new)}-{max(new)} "
        f"(sum {total}); "
        f"greedy; {args.running} sequences a step, KV budget {budget} tokens (pages of {PAGE})"
    )
    figures: dict[str, float] = {}

    def report(name: str, seconds: float, tokens: int) -> None:
        figures[name] = tokens / seconds
        print(
            f"{name:>34}: {tokens:6d} tokens in {seconds:7.2f} s = {tokens / seconds:8.1f} tokens/s",
            flush=True,
        )

    seconds, tokens = run_embedded(checkpoint, texts, new, budget, args.running, args)
    report("batchwork run (embedded, all in)", seconds, tokens)
    seconds, ours = run_engine(checkpoint, texts, new, budget, args.running, args)
    report("batchwork engine", seconds, sum(map(len, ours)))
    model = load_reference(checkpoint, args)
    seconds, theirs = run_transformers_cb(model, ids, new, budget, args.running)
    report("transformers continuous batching", seconds, sum(map(len, theirs)))
    model = load_reference(checkpoint, args)  # a live manager breaks later ordinary forwards (#48735)
    seconds, static = run_generate(model, ids, new, args.running)
    report(f"generate, static batches of {args.running}", seconds, sum(map(len, static)))
    if not args.skip_one_at_a_time:
        seconds, single = run_generate(model, ids, new, 1)
        report("generate, one at a time", seconds, sum(map(len, single)))
        print(
            "greedy ids equal to generate one at a time: "
            f"ours {sum(a == b for a, b in zip(ours, single, strict=True))}/{len(ids)}, "
            f"transformers CB {sum(a == b for a, b in zip(theirs, single, strict=True))}/{len(ids)}"
        )
    run, engine = figures["batchwork run (embedded, all in)"], figures["batchwork engine"]
    cb, static = (
        figures["transformers continuous batching"],
        figures[f"generate, static batches of {args.running}"],
    )
    print(
        f"\nembedded run / transformers CB: {run / cb:.2f}x (target >= 1.0x); engine alone {engine / cb:.2f}x"
    )
    if "generate, one at a time" in figures:
        print(
            f"embedded run / generate one at a time: {run / figures['generate, one at a time']:.2f}x "
            "(target >= 5x)"
        )
    print(
        f"embedded run / generate static batches: {run / static:.2f}x (target >= 2x); "
        f"engine alone {engine / static:.2f}x"
    )


if __name__ == "__main__":
    main()
