"""The continuous and static drivers on a fake step model and a fake clock (a step takes one second):
who joins when, and that arrival times hold. The GPT-2 tests run the same drivers on the real model."""

from __future__ import annotations

from collections.abc import Callable, Hashable

import pytest

from tests.support.batched_runs import Request, run_continuous, run_static
from worker.models.base import FinishedSequence


class StepClock:
    def __init__(self) -> None:
        self.now = 0.0

    def now_s(self) -> float:
        return self.now

    def wait_until(self, offset_s: float) -> None:
        self.now = max(self.now, offset_s)


class Countdown:
    """A step model whose payload is the number of steps a sequence runs; two slots."""

    max_running = 2

    def __init__(self, clock: StepClock) -> None:
        self.clock = clock
        self.left: dict[Hashable, int] = {}
        self.admitted_s: dict[Hashable, float] = {}

    def can_admit(self, length: int) -> bool:
        return len(self.left) < self.max_running and length <= 10

    def admit(self, key: Hashable, payload: object) -> None:
        assert isinstance(payload, int)
        self.left[key] = payload
        self.admitted_s[key] = self.clock.now

    def running(self) -> int:
        return len(self.left)

    def step(self) -> list[FinishedSequence]:
        self.clock.now += 1
        self.left = {key: steps - 1 for key, steps in self.left.items()}
        done = [
            FinishedSequence(key, output=self.clock.now) for key, steps in self.left.items() if steps == 0
        ]
        self.left = {key: steps for key, steps in self.left.items() if steps}
        return done


def requests(*steps_and_arrivals: tuple[int, float]) -> list[Request[int]]:
    return [Request(key, steps, 1, at) for key, (steps, at) in enumerate(steps_and_arrivals)]


def test_continuous_fills_a_free_slot_at_the_next_step() -> None:
    clock = StepClock()
    model = Countdown(clock)
    finished = run_continuous(model, requests((3, 0), (1, 0), (2, 0)), clock)
    assert model.admitted_s == {0: 0, 1: 0, 2: 1}
    assert [done.output for done in finished] == [3, 1, 3]


def test_static_admits_nothing_until_the_batch_has_finished() -> None:
    clock = StepClock()
    model = Countdown(clock)
    finished = run_static(model, requests((3, 0), (1, 0), (2, 0)), clock=clock)
    assert model.admitted_s == {0: 0, 1: 0, 2: 3}
    assert [done.output for done in finished] == [3, 1, 5]


@pytest.mark.parametrize("driver", [run_continuous, run_static])
def test_nothing_is_admitted_before_it_arrives(driver: Callable[..., list[FinishedSequence]]) -> None:
    clock = StepClock()
    model = Countdown(clock)
    finished = driver(model, requests((2, 0), (1, 0.5), (1, 10)), clock=clock)
    assert model.admitted_s[2] == 10
    assert finished[2].output == 11
    # Continuous takes the second at the step after it arrives; static once the first batch is done.
    assert model.admitted_s[1] == (1 if driver is run_continuous else 2)


def test_static_batch_size_one_runs_one_at_a_time() -> None:
    clock = StepClock()
    model = Countdown(clock)
    finished = run_static(model, requests((2, 0), (1, 0), (1, 0)), batch_size=1, clock=clock)
    assert [done.output for done in finished] == [2, 3, 4]


def test_a_request_the_model_can_never_admit_is_an_error() -> None:
    clock = StepClock()
    with pytest.raises(ValueError, match="'long' needs 11"):
        run_continuous(Countdown(clock), [Request("long", 1, length=11)], clock)
