"""What the engine's threads pass each other: deliveries (messages), slots, writes, and holdings.

Plain values and the bookkeeping of what a worker holds; no threads are started here and nothing
here talks to the broker or the database.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Protocol

from worker.calls import InferCall
from worker.store.results import BatchRecord, ItemOutcome, JobSpec, TokenCount


class Message(Protocol):
    """The part of a kombu message the engine uses."""

    headers: dict[str, Any]

    def decode(self) -> Any: ...


class Acks(Protocol):
    def ack(self, messages: Sequence[Message]) -> None: ...


class TaskEvents(Protocol):
    """Celery task events, so Flower shows each message as a task."""

    def received(self, delivery: Delivery) -> None: ...
    def started(self, delivery: Delivery) -> None: ...
    def finished(self, delivery: Delivery) -> None: ...


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

    @cached_property
    def job(self) -> JobSpec:
        assert self.call is not None
        return JobSpec(self.call.job_id, self.call.model, self.call.priority, self.call.total)


@dataclass(frozen=True, slots=True)
class Slot:
    """What the engine keeps of an item while it waits: its message, the user's id, its payload."""

    delivery: Delivery
    item_id: str | None
    payload: Any


@dataclass
class Write:
    """Outcomes for the store thread: ``deliveries[i]`` owes ``outcomes[i]``. Or, alone, running items'
    token counts (``tokens``): a progress report, which acknowledges nothing."""

    record: BatchRecord | None
    outcomes: list[ItemOutcome] = field(default_factory=list)
    deliveries: list[Delivery] = field(default_factory=list)
    degraded: bool = False  # outputs replaced by errors after the database refused them
    tokens: list[TokenCount] = field(default_factory=list)

    def add(self, outcome: ItemOutcome, delivery: Delivery) -> None:
        self.outcomes.append(outcome)
        self.deliveries.append(delivery)

    @property
    def jobs(self) -> list[JobSpec]:
        """The jobs of these outcomes, once each (the store creates any job row still missing)."""
        return list(dict.fromkeys(delivery.job for delivery in self.deliveries if delivery.call is not None))


class Holdings:
    """What the worker holds: unacknowledged deliveries, and items not yet stored by priority and job.

    Read by the consumer's thread (throttle, leases) and the run thread (cancel checks), changed by
    the prepare and store threads; one lock keeps the counts whole.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._deliveries: set[Delivery] = set()
        self._by_priority: Counter[str] = Counter()
        self._by_job: Counter[str] = Counter()

    def received(self, delivery: Delivery) -> None:
        with self._lock:
            self._deliveries.add(delivery)

    def hold(self, job: InferCall | JobSpec, count: int) -> None:
        """``count`` more (or, negative, fewer) items of ``job`` are waiting to be stored."""
        with self._lock:
            self._by_priority[job.priority] += count
            self._by_job[job.job_id] += count
            if self._by_job[job.job_id] <= 0:
                del self._by_job[job.job_id]

    def acknowledged(self, deliveries: Iterable[Delivery]) -> None:
        with self._lock:
            self._deliveries.difference_update(deliveries)

    def items(self, priority: str) -> int:
        return self._by_priority[priority]

    def jobs(self) -> list[str]:
        with self._lock:
            return list(self._by_job)

    def deliveries(self) -> list[Delivery]:
        with self._lock:
            return list(self._deliveries)
