"""The pure scheduling core: which items run together, and when.

Items wait in lanes (one per model x priority). A lane is ready when it holds N items or its
oldest item has waited T; the scheduler hands out a batch from the most urgent ready lane.
This module knows items, lanes, lengths and a clock reading, and must never import Celery,
Redis, SQLAlchemy or torch.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

LaneKey = tuple[str, str]  # (model, priority)


@dataclass(frozen=True, slots=True)
class LanePolicy:
    max_batch_size: int  # N
    max_wait_s: float  # T, counted from the arrival of the lane's oldest waiting item
    rank: int = 0  # lower is more urgent; ties go to the lane whose oldest item waited longest


@dataclass(frozen=True, slots=True)
class Item:
    job_id: str
    index: int
    length: int  # cost in tokens (1 for models without a notion of length)
    arrived: float  # clock reading when the item entered the worker
    ref: Any = None  # the runtime's own handle (payload, message); opaque here


@dataclass(frozen=True, slots=True)
class Batch:
    lane: LaneKey
    items: tuple[Item, ...]
    formed_at: float

    @property
    def model(self) -> str:
        return self.lane[0]

    @property
    def real_tokens(self) -> int:
        return sum(item.length for item in self.items)

    @property
    def padded_tokens(self) -> int:
        return max(item.length for item in self.items) * len(self.items)

    @property
    def oldest_wait_s(self) -> float:
        return self.formed_at - min(item.arrived for item in self.items)


@dataclass
class Lane:
    """Items of one model and priority, queued per job so that jobs share batches fairly."""

    key: LaneKey
    policy: LanePolicy
    jobs: OrderedDict[str, deque[Item]] = field(default_factory=OrderedDict)
    size: int = 0

    def add(self, item: Item) -> None:
        queue = self.jobs.get(item.job_id)
        if queue is None:
            queue = self.jobs[item.job_id] = deque()
        queue.append(item)
        self.size += 1

    def oldest_arrival(self) -> float:
        return min(queue[0].arrived for queue in self.jobs.values())

    def deadline(self) -> float:
        return self.oldest_arrival() + self.policy.max_wait_s

    def is_ready(self, now: float) -> bool:
        return self.size >= self.policy.max_batch_size or now >= self.deadline()

    def take(self, limit: int) -> list[Item]:
        """Up to ``limit`` items, one per job in turn, so a big job cannot shut out a small one.

        Jobs that gave an item move to the back of the rotation; the next batch starts with
        the jobs this one could not reach.
        """
        taken: list[Item] = []
        while len(taken) < limit and self.jobs:
            served = []
            for job_id, queue in self.jobs.items():
                taken.append(queue.popleft())
                served.append(job_id)
                if len(taken) == limit:
                    break
            for job_id in served:
                if self.jobs[job_id]:
                    self.jobs.move_to_end(job_id)
                else:
                    del self.jobs[job_id]
        self.size -= len(taken)
        return taken


class Scheduler:
    """Lanes of waiting items; ``next_batch`` decides what the model runs next."""

    def __init__(self, policy_for: Callable[[LaneKey], LanePolicy]) -> None:
        self._policy_for = policy_for
        self._lanes: dict[LaneKey, Lane] = {}

    def add(self, model: str, priority: str, item: Item) -> None:
        key = (model, priority)
        lane = self._lanes.get(key)
        if lane is None:
            lane = self._lanes[key] = Lane(key, self._policy_for(key))
        lane.add(item)

    def __len__(self) -> int:
        return sum(lane.size for lane in self._lanes.values())

    def next_batch(self, now: float, *, flush: bool = False) -> Batch | None:
        """The batch to run now, or None if no lane is ready. ``flush`` treats every lane as ready."""
        ready = [lane for lane in self._waiting() if flush or lane.is_ready(now)]
        if not ready:
            return None
        lane = min(ready, key=lambda lane: (lane.policy.rank, lane.oldest_arrival()))
        items = lane.take(lane.policy.max_batch_size)
        return Batch(lane.key, tuple(items), now)

    def next_deadline(self) -> float | None:
        """When the earliest lane becomes ready by waiting alone, or None when nothing waits."""
        deadlines = [lane.deadline() for lane in self._waiting()]
        return min(deadlines, default=None)

    def _waiting(self) -> Iterator[Lane]:
        return (lane for lane in self._lanes.values() if lane.size)
