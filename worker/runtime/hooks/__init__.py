"""Hook points on the engine, in the way of dramatiq's middleware: a feature that concerns every stage (the
poison-item journal, task events, metrics, cancellation, deadlines) is one module here, one ``Hook`` each, and
the threads call the hooks at five points instead of knowing the features.

Each point is called on the thread named in its docstring and gets only what it concerns: a hook is called
only for the messages in its ``scope``, and not at all while it is ``idle``, so a plain item never enters the
journal, deadlines or cancellation. A hook must not wait on the database there: what needs the database runs
on a thread of its own (cancellation.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from worker.batching.scheduler import Item
from worker.runtime.deliveries import Delivery, Pack, ResultsToStore
from worker.runtime.forward import Report
from worker.store.values import BatchRecord

# One message's items about to run together (its pack, and its items in the batch, in order).
Run = tuple[Pack, Sequence[Item]]


@dataclass(slots=True)
class Admission:
    """What hooks decided about a message's items as it arrived, by position in the message: items that end
    at once with an error (they never run), and items that must run alone."""

    ended: dict[int, str] = field(default_factory=dict)
    alone: set[int] = field(default_factory=set)


@dataclass(frozen=True, slots=True)
class Ran:
    """A batch that ran: its record (as stored) and the forward pass's report."""

    record: BatchRecord
    report: Report


# Which messages a hook has anything to do with; the engine calls it with no other. "every" message;
# "redelivered": those a worker died holding (``Delivery.lost``), the journal's suspects; "deadline": those
# whose job has a deadline (``InferMessage.expires_at``). Strings, not an Enum: the check runs per message,
# and an Enum member's lookup costs more on Python 3.11 than the hook call it saves.
Scope = Literal["every", "redelivered", "deadline"]


class Hook:
    """A feature woven through the engine. Every point does nothing here; a hook overrides those it needs."""

    scope: Scope = "every"
    # True while the hook has nothing to do for any message: the engine skips it, reading this without a
    # call. A hook whose work comes and goes (a cancel pending) keeps it; most never change it.
    idle = False

    def received(self, delivery: Delivery, admission: Admission) -> None:
        """Prepare thread: ``delivery.call`` was parsed, before its items are checked. A hook may end items
        or have them run alone through ``admission``."""

    def before_batch(self, runs: Sequence[Run]) -> dict[Pack, str]:
        """Run thread: these messages' items are about to run (a batch, or an item joining a step model).
        Returns the messages whose items must not run, with the error to store for them; a message dropped
        here never reaches the hooks after this one."""
        return {}

    def after_batch(self, runs: Sequence[Run], ran: Ran | None) -> None:
        """Run thread: these items ran (``ran`` is None for a sequence of a step model that finished)."""

    def after_store(self, write: ResultsToStore) -> None:
        """Store thread: ``write``'s outcomes are committed (or stored as errors, or let go), not yet
        acknowledged."""

    def settled(self, deliveries: Sequence[Delivery], error: str | None = None) -> None:
        """Store thread: these messages are acknowledged; ``error`` says why, if each was refused whole
        (it is not a valid call)."""


class Hooks:
    """The engine's hooks in order, each point calling only the hooks that implement it (most points cost a
    loop over nothing: they are called per batch and, for step models, per item)."""

    def __init__(self, hooks: Sequence[Hook] = ()) -> None:
        self.hooks = list(hooks)

        def implementing(point: str) -> list[Hook]:
            return [hook for hook in self.hooks if getattr(type(hook), point) is not getattr(Hook, point)]

        self._received = implementing("received")
        self._before_batch = implementing("before_batch")
        self._after_batch = implementing("after_batch")
        self._after_store = implementing("after_store")
        self._settled = implementing("settled")

    def received(self, delivery: Delivery) -> Admission:
        admission = Admission()
        for hook in self._received:
            if hook.idle:
                continue
            if hook.scope == "every" or _in_scope(hook.scope, delivery):
                hook.received(delivery, admission)
        return admission

    def before_batch(self, runs: list[Run]) -> tuple[list[Run], dict[Pack, str]]:
        """The runs that may run, and the messages dropped with their errors."""
        dropped: dict[Pack, str] = {}
        for hook in self._before_batch:
            mine = _runs_for(hook, runs)
            if not mine:
                continue
            now_dropped = hook.before_batch(mine)
            if now_dropped:
                dropped.update(now_dropped)
                runs = [run for run in runs if run[0] not in now_dropped]
                if not runs:
                    break
        return runs, dropped

    def after_batch(self, runs: Sequence[Run], ran: Ran | None) -> None:
        for hook in self._after_batch:
            mine = _runs_for(hook, runs)
            if mine:
                hook.after_batch(mine, ran)

    def after_store(self, write: ResultsToStore) -> None:
        for hook in self._after_store:
            if _write_for(hook, write):
                hook.after_store(write)

    def settled(self, deliveries: Sequence[Delivery], error: str | None = None) -> None:
        for hook in self._settled:
            if hook.scope == "every" and not hook.idle:
                hook.settled(deliveries, error)
            elif mine := [delivery for delivery in deliveries if _wants(hook, delivery)]:
                hook.settled(mine, error)


# Which messages a hook is called for, by its scope, in plain attribute checks: filtering must cost no more
# than the calls it saves (a plain item's message used to enter the journal, deadlines and cancellation at
# every point), so a hook of every message is passed without a call per message, and a batch's runs or a
# write are filtered in one comprehension. One function per shape the points pass: a message, runs, a write.


def _wants(hook: Hook, delivery: Delivery) -> bool:
    return not hook.idle and _in_scope(hook.scope, delivery)


def _in_scope(scope: Scope, delivery: Delivery) -> bool:
    if scope == "redelivered":
        return delivery.lost > 0
    return scope == "every" or (delivery.call is not None and delivery.call.expires_at is not None)


def _runs_for(hook: Hook, runs: Sequence[Run]) -> Sequence[Run]:
    if hook.idle:
        return ()
    if hook.scope == "redelivered":
        return [run for run in runs if run[0].suspect]
    if hook.scope == "deadline":
        return [run for run in runs if (call := run[0].delivery.call) and call.expires_at is not None]
    return runs


def _write_for(hook: Hook, write: ResultsToStore) -> bool:
    if hook.idle:
        return False
    if hook.scope == "redelivered":
        return any(delivery.lost for delivery, _ in write.runs)
    return hook.scope == "every" or any(_in_scope(hook.scope, delivery) for delivery, _ in write.runs)
