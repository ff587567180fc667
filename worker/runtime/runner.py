"""Runs one batch through a model and returns one outcome per item, isolating bad items.

A batch that raises is split in halves and each half run again, down to single items, so one
poison input fails alone with its error while the rest of its batch succeeds. Never raises.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Outcome:
    output: Any = None
    error: str | None = None


NO_OUTPUT = Outcome(error="the model returned no output (None) for this item")


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def run_isolated(forward: Callable[[Sequence[Any]], Sequence[Any]], payloads: Sequence[Any]) -> list[Outcome]:
    try:
        outputs = forward(payloads)
        if len(outputs) != len(payloads):
            # A model that drops or adds outputs would shift results onto the wrong items.
            raise RuntimeError(f"model returned {len(outputs)} outputs for {len(payloads)} inputs")
    except Exception as exc:  # the boundary that turns a model failure into stored errors
        if len(payloads) == 1:
            return [Outcome(error=describe(exc))]
        middle = len(payloads) // 2
        return run_isolated(forward, payloads[:middle]) + run_isolated(forward, payloads[middle:])
    return [Outcome(output=output) if output is not None else NO_OUTPUT for output in outputs]
