"""Times a loaded model's ``forward`` on the device: batches of N synthetic items of one length, repeated,
warm-up excluded, with the memory each batch took and out-of-memory caught (never fatal).

The device edge of tuning: torch is imported here, and only inside functions.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from worker.models.base import Model
from worker.runtime.forward import is_out_of_memory
from worker.settings import Settings
from worker.tuning.curve import Point, oom_point, point_from_runs

# Words that are one token each in BERT's and GPT-2's vocabularies, so a text of k of them is about k tokens.
ONE_TOKEN_WORDS = "the of and to in is was for that with as on by at from it this be are an or have has not"
WORDS = tuple(ONE_TOKEN_WORDS.split())


@dataclass(frozen=True, slots=True)
class Pacing:
    """How long to measure one point: runs until ``point_s`` is spent, within [min_runs, max_runs]."""

    point_s: float = 1.0
    min_runs: int = 5
    max_runs: int = 30

    def runs(self, first_run_s: float) -> int:
        return max(self.min_runs, min(self.max_runs, int(self.point_s / max(first_run_s, 1e-6))))


class Bench:
    """One loaded model on one device; ``measure(n, length)`` gives a curve Point."""

    def __init__(self, model: Model, device: str, pacing: Pacing, precision: str = "fp32") -> None:
        self.model = model
        self.device = device
        self.pacing = pacing
        self.precision = precision
        self._payloads: dict[int, Any] = {}

    def measure(self, n: int, length: int) -> Point:
        batch = [self.payload(length)] * n
        try:
            first_s = self._timed(batch)  # warm-up: the first call at a new shape allocates
            memory = MemoryProbe(self.device)
            runs_ms = [self._timed(batch) * 1000 for _ in range(self.pacing.runs(first_s))]
            peak = memory.peak_growth()
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            failed = True
        else:
            failed = False
        if failed:  # outside the except block, so the exception no longer pins the batch's tensors
            self.model.release_memory()
            return oom_point(n, length, self.precision)
        return point_from_runs(n, length, runs_ms, peak, precision=self.precision)

    def payload(self, length: int) -> Any:
        """One prepared item of ``length`` tokens (any item, for models without lengths)."""
        if length not in self._payloads:
            self._payloads[length] = synthetic_payload(self.model, length)
        return self._payloads[length]

    def _timed(self, batch: Sequence[Any]) -> float:
        started = time.perf_counter()
        self.model.forward(batch)
        synchronize(self.device)
        return time.perf_counter() - started


def synthetic_payload(model: Model, length: int) -> Any:
    """A prepared text of exactly ``length`` tokens where the tokenizer allows (special tokens counted)."""
    words = max(1, length)
    prepared = model.prepare([filler_text(words)])[0]
    if prepared.length not in (1, length):  # one correction: specials make tokens = words + a constant
        prepared = model.prepare([filler_text(max(1, words - (prepared.length - length)))])[0]
    return prepared.payload


def prepared_lengths(model: Model, items: Sequence[object]) -> list[int]:
    return [p.length for p in model.prepare(list(items))]


def filler_text(words: int) -> str:
    return " ".join(WORDS[i % len(WORDS)] for i in range(words))


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)


def free_memory_bytes(device: str) -> int | None:
    """Memory the device has free now: CUDA's free memory, or the host's MemAvailable."""
    if device.startswith("cuda"):
        import torch

        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    meminfo = Path("/proc/meminfo")
    if not meminfo.exists():
        return None
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


class MemoryProbe:
    """Peak memory growth from now: CUDA's max_memory_allocated, or the process's peak RSS (VmHWM).

    Linux resets VmHWM when "5" is written to /proc/self/clear_refs, so each point has its own peak;
    where that fails, the lifetime peak's growth is the best there is (0 until the peak is passed).
    """

    def __init__(self, device: str) -> None:
        self.device = device
        if device.startswith("cuda"):
            import torch

            torch.cuda.reset_peak_memory_stats(device)
            self.base = torch.cuda.memory_allocated(device)
            return
        _reset_peak_rss()
        self.base = _status_kib("VmRSS") * 1024

    def peak_growth(self) -> int | None:
        if self.device.startswith("cuda"):
            import torch

            return int(torch.cuda.max_memory_allocated(self.device) - self.base)
        peak = _status_kib("VmHWM") * 1024
        return max(0, peak - self.base) if peak else None


def _reset_peak_rss() -> None:
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def _status_kib(field: str) -> int:
    status = Path("/proc/self/status")
    if not status.exists():
        import resource

        # ru_maxrss is KiB on Linux, bytes on macOS
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak // 1024 if sys.platform == "darwin" else peak
    for line in status.read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    return 0


def with_precision(settings: Settings, cls: type[Model], precision: str) -> Settings:
    """The settings with ``cls``'s options block set to ``precision`` (its other options kept)."""
    block = {**settings.model_options.get(cls.name, {}), "precision": precision}
    return settings.model_copy(update={"model_options": {**settings.model_options, cls.name: block}})
