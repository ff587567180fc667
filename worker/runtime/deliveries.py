"""What the engine's threads pass each other: deliveries (messages), slots, the store's three kinds of work,
and the bookkeeping of what a worker holds.

Plain values; no threads are started here and nothing here talks to the broker or the database.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Protocol

from worker.calls import InferCall
from worker.store.values import BatchRecord, ItemOutcome, JobSpec, TokenCount


class Message(Protocol):
    """The part of a kombu message the engine uses."""

    headers: dict[str, Any]
    properties: dict[str, Any]
    delivery_tag: Any

    def decode(self) -> Any: ...


@dataclass(eq=False)
class Delivery:
    """One received message and how many of its items still owe a stored outcome."""

    message: Message
    received_at: float
    call: InferCall | None = None
    pending: int = 0
    started: bool = False
    failed: int = 0
    error: str | None = None

    @property
    def task_id(self) -> str:
        return str(self.message.headers.get("id"))

    @property
    def lost(self) -> int:
        """How often a worker holding this message vanished before acknowledging it (0: a first delivery)."""
        lost = self.message.properties.get("batchwork_lost", 0)
        return lost if isinstance(lost, int) else 0

    @cached_property
    def job(self) -> JobSpec:
        assert self.call is not None
        call = self.call
        return JobSpec(call.job_id, call.model, call.priority, call.total, call.created_at)


@dataclass(frozen=True, slots=True)
class Slot:
    """What the engine keeps of an item while it waits: its message, the user's id, its payload; whether it
    belongs to a message whose earlier worker died (a suspect, journaled before it runs), and whether it must
    run alone (see runtime/journal.py)."""

    delivery: Delivery
    item_id: str | None
    payload: Any
    suspect: bool = False
    isolated: bool = False


# The store thread's work: one of these three per hand-over.


@dataclass
class Outcomes:
    """Items' outcomes, ``deliveries[i]`` owing ``outcomes[i]``; with the batch that produced them, if any."""

    record: BatchRecord | None = None
    outcomes: list[ItemOutcome] = field(default_factory=list)
    deliveries: list[Delivery] = field(default_factory=list)

    def add(self, outcome: ItemOutcome, delivery: Delivery) -> None:
        self.outcomes.append(outcome)
        self.deliveries.append(delivery)

    @property
    def jobs(self) -> list[JobSpec]:
        """The jobs of these outcomes, once each (the store creates any job row still missing)."""
        return list(dict.fromkeys(delivery.job for delivery in self.deliveries))


@dataclass(frozen=True, slots=True)
class Refusal:
    """A message that cannot run at all (it is not a valid call): its job fails with ``error``."""

    delivery: Delivery
    error: str


@dataclass(frozen=True, slots=True)
class TokenReport:
    """Running items' token counts: progress only, best effort; it acknowledges nothing."""

    counts: list[TokenCount]


StoreWork = Outcomes | Refusal | TokenReport


class Holdings:
    """What the worker holds: unacknowledged deliveries, and items not yet stored by priority and job.

    Read by the consumer's thread (throttle, leases) and the watch thread (cancel checks), changed by the
    prepare and store threads; one lock keeps the counts whole.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._deliveries: set[Delivery] = set()
        self._by_priority: Counter[str] = Counter()
        self._by_job: Counter[str] = Counter()
        self._message_items: dict[str, int] = {}  # per priority: the items of the last message taken

    def received(self, delivery: Delivery) -> None:
        with self._lock:
            self._deliveries.add(delivery)

    def hold(self, job: InferCall | JobSpec, count: int) -> None:
        """``count`` more (or, negative, fewer) items of ``job`` are waiting to be stored."""
        with self._lock:
            if count > 0:
                self._message_items[job.priority] = count
            self._by_priority[job.priority] += count
            self._by_job[job.job_id] += count
            if self._by_job[job.job_id] <= 0:
                del self._by_job[job.job_id]

    def acknowledged(self, deliveries: Iterable[Delivery]) -> None:
        with self._lock:
            self._deliveries.difference_update(deliveries)

    def items(self, priority: str) -> int:
        return self._by_priority[priority]

    def message_items(self, priority: str) -> int | None:
        """How many items the last message of this priority held (None before the first)."""
        return self._message_items.get(priority)

    def jobs(self) -> list[str]:
        with self._lock:
            return list(self._by_job)

    def deliveries(self) -> list[Delivery]:
        with self._lock:
            return list(self._deliveries)
