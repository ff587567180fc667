"""How often the API's batch runner looks for OpenAI batches to advance: often while some are open, seldom
while none are (an idle API process asked PostgreSQL 20 times a second), and at once when one is made."""

from __future__ import annotations

import threading
import time
from typing import Any

from api.batch_runner import IDLE_POLL_S, POLL_S, BatchRunner


class Batches:
    """The runner's BatchStore, answering ``claimable`` with ``open`` and counting the looks."""

    def __init__(self) -> None:
        self.open: list[str] = []
        self.looks = 0
        self.looked = threading.Event()

    def claimable(self) -> list[str]:
        self.looks += 1
        self.looked.set()
        return list(self.open)

    def claim(self, batch_id: str, owner: str, lease_s: float) -> dict[str, Any] | None:
        return None  # another process holds it: nothing to step here


class Files:
    def sweep_expired(self) -> None:
        pass


def started(batches: Batches) -> BatchRunner:
    runner = BatchRunner(None, Files(), batches, None)  # type: ignore[arg-type]
    runner.start()
    assert batches.looked.wait(5)
    return runner


def test_an_idle_runner_looks_seldom_and_a_kick_wakes_it_at_once() -> None:
    batches = Batches()
    runner = started(batches)
    try:
        time.sleep(IDLE_POLL_S / 2)
        assert batches.looks == 1  # no batch open: no second look within IDLE_POLL_S
        batches.looked.clear()
        kicked = time.monotonic()
        runner.kick()
        assert batches.looked.wait(5)
        assert time.monotonic() - kicked < IDLE_POLL_S / 2
    finally:
        runner.close()


def test_a_runner_with_open_batches_looks_every_poll() -> None:
    batches = Batches()
    batches.open = ["batch_1"]
    runner = started(batches)
    try:
        time.sleep(POLL_S * 8)
    finally:
        runner.close()
    assert batches.looks >= 4
