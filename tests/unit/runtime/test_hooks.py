"""The engine's hook points: hooks run in order, a message one hook drops never reaches the hooks after it,
the cancellation and deadline hooks drop whole messages with the error stored for their items, and the
journal's rule for where a suspect runs."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from worker.batching.scheduler import Item
from worker.calls import InferMessage
from worker.runtime.deliveries import Delivery, Holdings, Pack
from worker.runtime.hooks import Hook, Hooks, Run, Scope
from worker.runtime.hooks.cancellation import Cancellation
from worker.runtime.hooks.deadlines import EXPIRED, Deadlines
from worker.runtime.hooks.journal import placement


class FakeMessage:
    def __init__(self) -> None:
        self.headers: dict[str, Any] = {"id": "t"}
        self.properties: dict[str, Any] = {}
        self.delivery_tag = "t"

    def decode(self) -> Any:
        return (), {}, {}


def run_of(job_id: str, size: int = 2, expires_at: float | None = None) -> Run:
    delivery = Delivery(FakeMessage(), 0.0)
    delivery.call = InferMessage(job_id, "noop", ["x"] * size, "normal", expires_at=expires_at)
    pack = Pack(delivery, 0, ["x"] * size, None)
    return pack, tuple(Item(job_id, index, 1, 0.0, pack) for index in range(size))


class Seen(Hook):
    def __init__(self) -> None:
        self.jobs: list[str] = []

    def before_batch(self, runs: Sequence[Run]) -> dict[Pack, str]:
        self.jobs += [item.job_id for _, mine in runs for item in mine[:1]]
        return {}


class NoCancels:
    def cancelled(self, job_ids: Any) -> set[str]:
        return {"gone"}


def test_a_dropped_message_never_reaches_the_hooks_after_the_one_that_dropped_it() -> None:
    cancels = Cancellation(NoCancels(), Holdings())  # type: ignore[arg-type]
    cancels.refresh()
    seen = Seen()
    hooks = Hooks([cancels, Deadlines(), seen])
    runs = [run_of("kept"), run_of("gone"), run_of("late", expires_at=time.time() - 1)]
    left, dropped = hooks.before_batch(runs)
    assert [pack.delivery.call.job_id for pack, _ in left] == ["kept"]  # type: ignore[union-attr]
    assert sorted(dropped.values()) == sorted(["cancelled", EXPIRED])
    assert seen.jobs == ["kept"]


class SeenWithDeadline(Seen):
    scope: Scope = "deadline"


def test_a_hook_is_called_only_for_the_messages_in_its_scope_and_not_while_idle() -> None:
    cancels = Cancellation(NoCancels(), Holdings())  # type: ignore[arg-type]
    timed, seen = SeenWithDeadline(), Seen()
    hooks = Hooks([cancels, timed, seen])
    runs = [run_of("gone"), run_of("timed", expires_at=time.time() + 60)]
    left, dropped = hooks.before_batch(runs)
    assert (len(left), dropped) == (2, {})  # no cancel known yet: cancellation is idle
    assert timed.jobs == ["timed"] and seen.jobs == ["gone", "timed"]
    cancels.refresh()
    left, _ = hooks.before_batch(runs)
    assert [pack.delivery.call.job_id for pack, _ in left] == ["timed"]  # type: ignore[union-attr]


def test_a_suspect_runs_with_the_others_after_one_death_alone_after_two_or_on_its_last_run() -> None:
    # The default cap (3): the second delivery runs in a batch, the third (the last allowed) alone, and a
    # third death ends the item with its error.
    assert [placement(deaths, 3) for deaths in range(4)] == ["batch", "alone", "ended", "ended"]
    # A higher cap tolerates churn: one death (a preempted node) does not serialise the batch that died.
    assert [placement(deaths, 20) for deaths in (0, 1, 2, 17, 18, 19)] == [
        "batch",
        "batch",
        "alone",
        "alone",
        "alone",
        "ended",
    ]
    # A cap of 2: the only rerun is the last, so it runs alone; a cap of 1 never reruns a suspect.
    assert [placement(deaths, 2) for deaths in range(2)] == ["alone", "ended"]
    assert placement(0, 1) == "ended"
