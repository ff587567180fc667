"""`batchwork tune` for step models (continuous batching, e.g. gpt2): the sweep is over running sequences
per prompt length, timing one decode step (p50/p99; each step yields one token per sequence), and the
recommendation adds the KV-cache budget the memory cap allows.

The device edge for step models; the choice itself is worker.tuning.choice, as for batch models.
"""

from __future__ import annotations

import time
from dataclasses import replace
from itertools import count
from typing import Any

from rich.console import Console

from worker.models.base import FinishedSequence, StepModel
from worker.models.device import device_kind, resolve_device
from worker.settings import Settings
from worker.tuning.choice import choose, knees
from worker.tuning.curve import Point, oom_point, point_from_runs
from worker.tuning.measure import MemoryProbe, Pacing, filler_text, free_memory_bytes, synchronize
from worker.tuning.sweep import progress_bar, sweep_lengths

AUTO_PROMPT_LENGTHS = (16, 64)
PAGE_TOKENS = 16


class StepBench:
    """Keeps ``n`` sequences of ``length``-token prompts running and times the decode steps."""

    def __init__(self, model: StepModel, device: str, pacing: Pacing, new_tokens: int) -> None:
        self.model = model
        self.device = device
        self.pacing = pacing
        self.new_tokens = new_tokens
        self._keys = count()

    def measure(self, n: int, length: int) -> Point:
        prompt = _prompt(self.model, length, self.new_tokens)
        try:
            self._fill(n, prompt)
            self._step()  # prefill (untimed), then one warm-up decode step
            first_s = self._step()
            memory = MemoryProbe(self.device)
            runs_ms = [self._timed_step(n, prompt) * 1000 for _ in range(self.pacing.runs(first_s))]
            peak = memory.peak_growth()
        except Exception as exc:
            from worker.runtime.forward import is_out_of_memory

            if not is_out_of_memory(exc):
                raise
            runs_ms = []
        self._drain()
        if not runs_ms:
            return oom_point(n, length)
        return point_from_runs(n, length, runs_ms, peak, step=True)

    def _fill(self, n: int, prompt: Any) -> None:
        while self.model.running() < n and self.model.can_admit(prompt.kv_tokens):
            self.model.admit(next(self._keys), prompt)

    def _timed_step(self, n: int, prompt: Any) -> float:
        """One decode step of all ``n``; sequences that finished are replaced and prefilled untimed first."""
        if self.model.running() < n:
            self._fill(n, prompt)
            self._step()
        return self._step()

    def _step(self) -> float:
        started = time.perf_counter()
        finished: list[FinishedSequence] = self.model.step()
        synchronize(self.device)
        del finished
        return time.perf_counter() - started

    def _drain(self) -> None:
        while self.model.running():
            self.model.step()


def _prompt(model: StepModel, length: int, new_tokens: int) -> Any:
    words = length
    for _ in range(2):  # one correction, as for batch models: a tokenizer may split or merge words
        item = {"prompt": filler_text(words), "max_new_tokens": new_tokens}
        prepared = model.prepare([model.validate(0, item, model.settings)])[0]
        words = max(1, words - (len(prepared.payload.token_ids) - length))
    if prepared.payload.error:
        raise ValueError(f"cannot build a {length}-token prompt: {prepared.payload.error}")
    return prepared.payload


def tune_steps(
    request: Any, cls: type[StepModel], settings: Settings, console: Console
) -> tuple[dict[str, Any], list[Point]]:
    from worker.tuning.request import TuneError
    from worker.tuning.result import build_result

    device = resolve_device(settings.device)
    if request.precisions and set(request.precisions) != {"fp32"}:
        raise TuneError(f"{request.model} runs in fp32 only for now; drop --precisions")
    new_tokens = request.pacing.max_runs + 4
    lengths = list(request.lengths or AUTO_PROMPT_LENGTHS)
    budget = _pages(request.max_n * (max(lengths) + new_tokens) + PAGE_TOKENS * request.max_n)
    options = {
        **settings.model_options,
        request.model: {**settings.model_options.get(request.model, {}), "kv_budget_tokens": budget},
    }
    model = cls(settings.model_copy(update={"model_options": options}))
    model.max_running = request.max_n  # type: ignore[misc]  # the sweep may go past the served default
    model.load(device)
    context = getattr(model, "context_tokens", None)
    if context is not None and max(lengths) + new_tokens > context:
        raise TuneError(
            f"--lengths: prompts of {max(lengths)} tokens + {new_tokens} new exceed the context of {context}"
        )
    bench = StepBench(model, device, request.pacing, new_tokens)
    with progress_bar(console) as progress:
        points = sweep_lengths(bench.measure, lengths, request, progress, "running sequences")
    kind = device_kind(device)
    cap = _memory_cap(model, device, budget, request.memory_fraction)
    # Prompt lengths vary the step's cost, but a step model has no token budget to set: the KV cache is it.
    lanes = {
        name: replace(c, max_batch_tokens=None)
        for name, c in choose(points, request.max_batch_ms, None).items()
    }
    result = build_result(request, cls, device, kind, "fp32", cap, lanes, points, None)
    result["knee"] = {str(length): n for length, n in knees(points).items()}
    result["kv_budget_tokens"] = _kv_budget(model, cap, lanes, context)
    result["tokens_per_s"] = result.pop("items_per_s")
    result["p99_step_ms"] = result["p99_batch_ms"]
    if request.apply:
        from worker.tuning.result import apply_choice

        apply_choice(settings, request.model, kind, lanes, result)
    return result, points


def _pages(tokens: int) -> int:
    return -(-tokens // PAGE_TOKENS) * PAGE_TOKENS


def _memory_cap(model: StepModel, device: str, sweep_budget: int, fraction: float) -> int | None:
    """F of the memory free with the sweep's own cache given back (it is the cache being sized)."""
    free = free_memory_bytes(device)
    per_token = getattr(model, "kv_bytes_per_token", lambda: None)()
    if free is None or per_token is None:
        return None
    return int((free + sweep_budget * per_token) * fraction)


def _kv_budget(model: StepModel, cap: int | None, lanes: dict[str, Any], context: int | None) -> int | None:
    """The cache the memory cap holds, but no more than the bulk lane's sequences can fill at full context."""
    per_token = getattr(model, "kv_bytes_per_token", lambda: None)()
    if cap is None or per_token is None:
        return None
    budget = cap // per_token
    running = lanes["bulk"].max_batch_size
    if running and context:
        budget = min(budget, running * context)
    return budget // PAGE_TOKENS * PAGE_TOKENS
