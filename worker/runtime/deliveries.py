"""What the engine's threads pass each other: deliveries (messages), packs (their items as columns), the
store's three kinds of work, and the bookkeeping of what a worker holds.

Plain values; no threads are started here and nothing here talks to the broker or the database.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Protocol

from worker.calls import InferMessage
from worker.store.values import BatchRecord, ItemColumns, ItemRecord, JobSpec, TokenCount


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
    call: InferMessage | None = None
    pending: int = 0
    started: bool = False
    failed: int = 0
    error: str | None = None

    @cached_property
    def task_id(self) -> str:
        return str(self.message.headers.get("id"))

    @property
    def queue(self) -> str:
        """The queue it was fetched from ("" where no transport says: the embedded run's broker)."""
        return str(self.message.properties.get("batchwork_queue", ""))

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


@dataclass(eq=False, slots=True)
class Pack:
    """What the engine keeps of a message's items while they wait, as columns by position in the message:
    payloads (None for items that will not run) and the users' ids; whether the message's earlier worker
    died (its items are suspects, journaled before they run) and which positions must run alone (see
    hooks/journal.py). Every Item of the message refers to it; nothing is kept per item but the Item."""

    delivery: Delivery
    offset: int  # the job index of position 0
    payloads: list[Any]
    item_ids: list[str | None] | None  # None: no item has an id of its own
    suspect: bool = False
    isolated: frozenset[int] = frozenset()  # positions
    where: dict[int, int] | None = None  # job index -> position, for a message with indices of its own

    def position(self, index: int) -> int:
        return index - self.offset if self.where is None else self.where[index]

    def payload(self, index: int) -> Any:
        return self.payloads[self.position(index)]

    def item_id(self, index: int) -> str | None:
        return None if self.item_ids is None else self.item_ids[self.position(index)]

    def ids_of(self, indices: list[int]) -> list[str | None]:
        if self.item_ids is None:
            return [None] * len(indices)
        return self._column_of(self.item_ids, indices)

    def payloads_of(self, indices: list[int]) -> list[Any]:
        return self._column_of(self.payloads, indices)

    def _column_of(self, column: list[Any], indices: list[int]) -> list[Any]:
        """``column``'s values at these job indices (maps in C: a batch asks for a thousand at a time)."""
        if self.where is not None:
            return list(map(column.__getitem__, map(self.where.__getitem__, indices)))
        if self.offset:
            return list(map(column.__getitem__, map(self.offset.__rsub__, indices)))
        return list(map(column.__getitem__, indices))

    def alone(self, index: int) -> bool:
        return bool(self.isolated) and self.position(index) in self.isolated


# The store thread's work: one of these three per hand-over.


@dataclass
class ResultsToStore:
    """Item records for the store thread to write (as ItemColumns), with the batch that produced them, if
    any. ``runs`` says which delivery owes which: (delivery, count) for consecutive rows, so a batch of one
    message's items is one run and is settled as one, not item by item."""

    record: BatchRecord | None = None
    columns: ItemColumns = field(default_factory=ItemColumns)
    runs: list[tuple[Delivery, int]] = field(default_factory=list)

    def add(self, outcome: ItemRecord, delivery: Delivery) -> None:
        self.columns.append(outcome)
        self._owe(delivery, 1)

    def extend(
        self,
        delivery: Delivery,
        indices: list[int],
        item_ids: list[str | None],
        outputs: list[Any],
        errors: list[str | None],
    ) -> None:
        """Results of items of ``delivery`` (each with exactly one of output and error)."""
        assert delivery.call is not None
        self.columns.extend(delivery.call.job_id, indices, item_ids, outputs, errors)
        self._owe(delivery, len(indices))

    def _owe(self, delivery: Delivery, count: int) -> None:
        if self.runs and self.runs[-1][0] is delivery:
            self.runs[-1] = (delivery, self.runs[-1][1] + count)
        elif count:
            self.runs.append((delivery, count))

    def __len__(self) -> int:
        return len(self.columns)

    @property
    def outcomes(self) -> list[ItemRecord]:
        """One ItemRecord per item (for the rare paths that go item by item)."""
        return self.columns.outcomes()

    @property
    def deliveries(self) -> list[Delivery]:
        """The delivery owing each outcome, in order."""
        return [delivery for delivery, count in self.runs for _ in range(count)]

    @property
    def jobs(self) -> list[JobSpec]:
        """The jobs of these outcomes, once each (the store creates any job row still missing)."""
        return list(dict.fromkeys(delivery.job for delivery, _ in self.runs))


@dataclass(frozen=True, slots=True)
class Refusal:
    """A message that cannot run at all (it is not a valid call): its job fails with ``error``."""

    delivery: Delivery
    error: str


@dataclass(frozen=True, slots=True)
class TokenReport:
    """Running items' token counts: progress only, best effort; it acknowledges nothing."""

    counts: list[TokenCount]


StoreWork = ResultsToStore | Refusal | TokenReport


class ToStore(Protocol):
    """Where the prepare and run threads put what the store thread is to write (``Storer.put``)."""

    def put(self, work: StoreWork, /) -> None: ...


class Holdings:
    """What the worker holds: unacknowledged deliveries, and by queue how many the prepare thread has not yet
    read; items not yet stored, by priority and job; and of those, the items still waiting to run (not yet
    handed to the store thread), by priority.

    Read by the consumer's thread (throttle, leases) and the watch thread (cancel checks), changed by the
    prepare and store threads; one lock keeps the counts whole.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._deliveries: set[Delivery] = set()
        # By queue: received, not yet read by the prepare thread (their items are not counted yet).
        self._unread: Counter[str] = Counter()
        self._by_priority: Counter[str] = Counter()
        self._waiting: Counter[str] = Counter()
        self._handed = 0  # items handed to the store thread so far (the fetch throttle's rate)
        self._by_job: Counter[str] = Counter()
        self._message_items: dict[str, int] = {}  # per priority: the items of the last message taken

    def received(self, delivery: Delivery) -> None:
        with self._lock:
            self._deliveries.add(delivery)
            self._unread[delivery.queue] += 1

    def read(self, deliveries: Iterable[Delivery]) -> None:
        """The prepare thread has taken these received deliveries (their items, if any, are held now)."""
        with self._lock:
            self._unread.subtract(delivery.queue for delivery in deliveries)

    def unread(self, queue: str) -> int:
        """Deliveries from ``queue`` received and not yet read: the throttle counts each as a message."""
        return self._unread[queue]

    def hold(self, job: InferMessage | JobSpec, count: int) -> None:
        """``count`` more (or, negative, fewer) items of ``job`` are waiting to be stored."""
        with self._lock:
            if count > 0:
                self._message_items[job.priority] = count
                self._waiting[job.priority] += count
            self._by_priority[job.priority] += count
            self._by_job[job.job_id] += count
            if self._by_job[job.job_id] <= 0:
                del self._by_job[job.job_id]

    def handed(self, runs: Iterable[tuple[Delivery, int]]) -> None:
        """These items have their outcomes and go to the store: they no longer wait to run."""
        with self._lock:
            for delivery, count in runs:
                self._waiting[delivery.job.priority] -= count
                self._handed += count

    def acknowledged(self, deliveries: Iterable[Delivery]) -> None:
        with self._lock:
            self._deliveries.difference_update(deliveries)

    def items(self, priority: str) -> int:
        """Items of ``priority`` not yet stored."""
        return self._by_priority[priority]

    def waiting(self, priority: str) -> int:
        """Items of ``priority`` not yet run (what another worker could have run instead)."""
        return self._waiting[priority]

    def handed_items(self) -> int:
        """Items handed to the store thread since the worker started."""
        return self._handed

    def message_items(self, priority: str) -> int | None:
        """How many items the last message of this priority held (None before the first)."""
        return self._message_items.get(priority)

    def jobs(self) -> list[str]:
        with self._lock:
            return list(self._by_job)

    def deliveries(self) -> list[Delivery]:
        with self._lock:
            return list(self._deliveries)
