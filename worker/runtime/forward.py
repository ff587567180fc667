"""Runs one batch through a model and reports an output or an error per item, isolating bad items.

A batch that raises is split in halves and each half run again, down to single items, so one
poison input fails alone with its error while the rest of its batch succeeds. Running out of
memory splits the same way and is reported, so the engine can lower that model's N. Never raises.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from worker.bounds import storable

NO_OUTPUT = "the model returned no output (None) for this item"


@dataclass
class Report:
    """What a batch's run made of each payload, as two columns: ``outputs[i]`` or ``errors[i]`` is set,
    never both."""

    outputs: list[Any] = field(default_factory=list)
    errors: list[str | None] = field(default_factory=list)
    out_of_memory_at: int | None = None  # size of the largest sub-batch that ran out of memory
    largest_ok: int = 0  # size of the largest sub-batch that ran

    @property
    def failed(self) -> bool:
        return self.errors.count(None) != len(self.errors)


def error_text(exc: BaseException) -> str:
    """An exception as an item's stored error; a NUL or lone surrogate its message repeats is escaped, so
    SQLite and PostgreSQL store the same line."""
    return storable(f"{type(exc).__name__}: {exc}")


def is_out_of_memory(exc: BaseException) -> bool:
    """torch.cuda.OutOfMemoryError (and torch.OutOfMemoryError), or the CPU allocator's failure."""
    if type(exc).__name__ == "OutOfMemoryError" or isinstance(exc, MemoryError):
        return True
    text = str(exc)
    return "out of memory" in text.lower() or "can't allocate memory" in text


def run_batch(
    forward: Callable[[Sequence[Any]], Sequence[Any]],
    payloads: Sequence[Any],
    release_memory: Callable[[], None] = lambda: None,
) -> Report:
    report = Report()
    _run(forward, payloads, release_memory, report)
    return report


def _run(
    forward: Callable[[Sequence[Any]], Sequence[Any]],
    payloads: Sequence[Any],
    release_memory: Callable[[], None],
    report: Report,
) -> None:
    error: str | None = None
    out_of_memory = False
    try:
        outputs = forward(payloads)
        if len(outputs) != len(payloads):
            # A model that drops or adds outputs would shift results onto the wrong items.
            raise RuntimeError(f"model returned {len(outputs)} outputs for {len(payloads)} inputs")
    except Exception as exc:  # the boundary that turns a model failure into stored errors
        error, out_of_memory = error_text(exc), is_out_of_memory(exc)
    if error is None:
        report.largest_ok = max(report.largest_ok, len(payloads))
        outputs = list(outputs)
        if any(output is None for output in outputs):
            report.outputs += outputs
            report.errors += [None if output is not None else NO_OUTPUT for output in outputs]
        else:
            report.outputs += outputs
            report.errors += [None] * len(outputs)
        return
    if out_of_memory:
        # Out of the except block: the exception no longer pins the failed batch's tensors.
        release_memory()
        report.out_of_memory_at = max(report.out_of_memory_at or 0, len(payloads))
        if len(payloads) == 1:
            error = f"out of memory even alone: {error}"
    if len(payloads) == 1:
        report.outputs.append(None)
        report.errors.append(error)
        return
    middle = len(payloads) // 2
    _run(forward, payloads[:middle], release_memory, report)
    _run(forward, payloads[middle:], release_memory, report)
