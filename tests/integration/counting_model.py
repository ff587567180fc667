"""A user's own step model, ``tests.integration.counting_model:Counter``: no weights, no torch.

Each item ``{"count": n}`` runs as a sequence that gains one "token" per step, taking ``STEP_S`` a
step, and leaves after n with the numbers it counted; long enough that a test sees it running.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from worker.models.base import Finished, InvalidInput, Prepared, StepModel

STEP_S = 0.02


class Counter(StepModel):
    name = "counter"
    max_running = 4

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._running: dict[Any, tuple[int, list[int]]] = {}

    @classmethod
    def validate(cls, index: int, item: object, settings: Any) -> int:
        if not isinstance(item, dict) or not isinstance(item.get("count"), int) or item["count"] < 1:
            raise InvalidInput('an item is {"count": n} with n >= 1', index)
        return item["count"]

    def prepare(self, checked: Sequence[int]) -> list[Prepared]:
        return [Prepared(count, count) for count in checked]

    def can_admit(self, length: int) -> bool:
        return len(self._running) < self.max_running

    def admit(self, key: Any, payload: Any) -> None:
        self._running[key] = (payload, [])

    def running(self) -> int:
        return len(self._running)

    def progress(self) -> list[tuple[Any, int]]:
        return [(key, len(counted)) for key, (_, counted) in self._running.items()]

    def step(self) -> list[Finished]:
        time.sleep(STEP_S)
        done = []
        for key, (count, counted) in list(self._running.items()):
            counted.append(len(counted) + 1)
            if len(counted) == count:
                del self._running[key]
                done.append(Finished(key, {"counted": counted}, tokens=count))
        return done
