"""Runs one batch through a model and reports an output or an error per item, isolating bad items.

A batch that raises is split in halves and each half run again, down to single items, so one
poison input fails alone with its error while the rest of its batch succeeds. Running out of
memory splits the same way and is reported, so the engine can lower that model's N. Never raises.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from worker.bounds import storable
from worker.errors import MODEL_FAILURES

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


def output_error(output: Any) -> str | None:
    """Why ``output`` cannot be an item's stored output, if it cannot: None, or a NaN or an infinity at its
    top or in a flat vector of numbers (a list, a numpy array: an embedding), which JSON has no word for:
    orjson writes null, and the item would read as neither answered nor failed, or a vector as nulls.
    (Deeper, in an object or a list of lists, it is written as null, unchecked: a walk of every output
    would cost more than storing it.)"""
    if output is None:
        return NO_OUTPUT
    kind, floats = type(output), _float_types()
    if kind in floats:
        finite = math.isfinite(output)
    elif kind is list or kind is tuple:
        finite = _finite_numbers(output)
    elif kind.__name__ == "ndarray" and output.dtype.kind in "fc":
        finite = bool(sys.modules["numpy"].isfinite(output).all())
    else:
        return None
    if finite:
        return None
    shown = f"{float(output)}" if kind in floats else "a vector holding NaN or infinity"
    return f"the model returned {shown} for this item, which JSON cannot hold"


def output_errors(outputs: Sequence[Any]) -> list[str | None]:
    """``output_error`` of each output, in one pass of type checks while none is suspect (a noop's int)."""
    suspects = {type(None), list, tuple, *_float_types()}
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        suspects.add(numpy.ndarray)
    if not any(type(output) in suspects for output in outputs):
        return [None] * len(outputs)
    return list(map(output_error, outputs))


def _finite_numbers(values: list[Any] | tuple[Any, ...]) -> bool:
    """False only for a list of numbers holding a NaN or an infinity: their sum is then NaN or infinite (a
    loop in C), and only then is each one checked (a sum of huge finite numbers may overflow alone)."""
    try:
        return math.isfinite(sum(values)) or all(map(math.isfinite, values))
    except (TypeError, OverflowError):  # not all numbers (or an int no float holds): not checked here
        return True


def _float_types() -> frozenset[type]:
    # Never imported here: a model that made a numpy float imported numpy. Made once per module, not per item.
    return _floats_of(sys.modules.get("numpy"))


@cache
def _floats_of(numpy: Any) -> frozenset[type]:
    return frozenset({float} if numpy is None else {float, numpy.float16, numpy.float32, numpy.float64})


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
    except MODEL_FAILURES as exc:  # the boundary that turns a model failure into stored errors
        error, out_of_memory = error_text(exc), is_out_of_memory(exc)
    if error is None:
        report.largest_ok = max(report.largest_ok, len(payloads))
        outputs = list(outputs)
        errors = output_errors(outputs)
        report.outputs += (
            outputs
            if errors.count(None) == len(errors)
            else [None if error else output for output, error in zip(outputs, errors, strict=True)]
        )
        report.errors += errors
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
