"""Whole runs of a StepModel over a list of requests, batched continuously or statically: the one
implementation of each that the tests and the benchmarks share.

The worker never calls these (its engine admits as messages come and never waits for a batch to end).
Nothing here imports torch; a request's arrival time is honoured by sleeping until it, on a clock the
caller may share with whatever records the run.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

P = TypeVar("P")


class Keyed(Protocol):
    """What a step returns for each sequence that left: a ``FinishedSequence`` or a ``RetiredSequence``."""

    @property
    def key(self) -> Hashable: ...


K = TypeVar("K", bound=Keyed)


class Stepper(Protocol[K]):
    """What a driver drives: a StepModel, or a wrapper around one that records what the run did."""

    @property
    def max_running(self) -> int: ...
    def can_admit(self, length: int) -> bool: ...
    def admit(self, key: Hashable, payload: Any) -> None: ...
    def running(self) -> int: ...
    def step(self) -> list[K]: ...


@dataclass(frozen=True, slots=True)
class Request(Generic[P]):
    """One sequence to run: its key, what ``admit`` takes, what ``can_admit`` is asked (Prepared.length),
    and when it arrives, in seconds from the run's start (0: there from the start)."""

    key: Hashable
    payload: P
    length: int
    arrival_s: float = 0.0


class Clock(Protocol):
    def now_s(self) -> float:
        """Seconds since the run started."""
        ...

    def wait_until(self, offset_s: float) -> None:
        """Return once ``now_s()`` has reached ``offset_s``."""
        ...


class WallClock:
    """time.monotonic from its creation on; waiting sleeps."""

    def __init__(self) -> None:
        self.started = time.monotonic()

    def now_s(self) -> float:
        return time.monotonic() - self.started

    def wait_until(self, offset_s: float) -> None:
        delay = self.started + offset_s - time.monotonic()
        if delay > 0:
            time.sleep(delay)


def run_continuous(model: Stepper[K], requests: Sequence[Request[P]], clock: Clock | None = None) -> list[K]:
    """Continuous batching: before every step, admit whatever has arrived while ``can_admit`` allows; a
    sequence leaves the batch at the step it finishes. Idle, wait for the next arrival. Returns what each
    request finished with, in the order of ``requests``."""
    clock = clock or WallClock()
    queued, finished = deque(requests), dict[Hashable, K]()
    while queued or model.running():
        if not model.running():
            clock.wait_until(queued[0].arrival_s)
        _admit_arrived(model, queued, math.inf, clock)
        finished.update((done.key, done) for done in model.step())
    return [finished[request.key] for request in requests]


def run_static(
    model: Stepper[K],
    requests: Sequence[Request[P]],
    batch_size: int | None = None,
    clock: Clock | None = None,
) -> list[K]:
    """Static batching: when the model is free, take what has arrived (else wait for the next arrival), up
    to ``batch_size`` (default max_running) and as far as ``can_admit`` allows, and step until all of it
    has finished, admitting nothing meanwhile; a finished row leaves and costs nothing more.
    ``batch_size=1`` runs one sequence at a time. Returns what each request finished with, in order."""
    clock = clock or WallClock()
    size = batch_size or model.max_running
    queued, finished = deque(requests), dict[Hashable, K]()
    while queued:
        clock.wait_until(queued[0].arrival_s)
        _admit_arrived(model, queued, size, clock)
        while model.running():
            finished.update((done.key, done) for done in model.step())
    return [finished[request.key] for request in requests]


def _admit_arrived(model: Stepper[K], queued: deque[Request[P]], most: float, clock: Clock) -> None:
    """Admit, in order, up to ``most`` of the requests that have arrived, while ``can_admit`` allows.
    Raises if the model is idle and still cannot take the next one: it never could."""
    now, room = clock.now_s(), most
    while queued and queued[0].arrival_s <= now and room > 0 and model.can_admit(queued[0].length):
        request = queued.popleft()
        model.admit(request.key, request.payload)
        room -= 1
    if queued and queued[0].arrival_s <= now and not model.running():
        raise ValueError(f"request {queued[0].key!r} needs {queued[0].length}; the model can never admit it")
