"""The pure scheduling core: which items run together, and when.

Items wait in lanes (model x priority), and inside a lane in length buckets. A lane is ready when a
bucket holds N items or a full token budget, or when its oldest item has waited T; the scheduler
hands out a batch from the most urgent ready lane, with aging so that no lane starves. This module
knows items, lengths and a clock reading, and must never import Celery, Redis, SQLAlchemy or torch.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from worker.batching.buckets import Bucket
from worker.batching.policy import LanePolicy

LaneKey = tuple[str, str]  # (model, priority)


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
    """The items of one model and priority, in length buckets."""

    key: LaneKey
    configured: LanePolicy
    buckets: list[Bucket] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.size = 0  # kept, not summed: it is read once per item added
        self.waiting_since = self.served_at = float("-inf")
        self.policy = self.configured  # the configured policy, with N lowered while a size cap holds
        self.buckets = [Bucket() for _ in range(len(self.policy.bucket_edges) + 1)]

    def cap_size(self, cap: int | None) -> None:
        size = self.configured.max_batch_size if cap is None else min(cap, self.configured.max_batch_size)
        self.policy = replace(self.configured, max_batch_size=size)

    def reconfigure(self, policy: LanePolicy, cap: int | None) -> None:
        """Take a new policy (tuned limits changed); waiting items stay, re-bucketed if the edges moved."""
        edges = self.configured.bucket_edges
        self.configured = policy
        self.cap_size(cap)
        if policy.bucket_edges == edges:
            return
        waiting = sorted(
            (item for bucket in self.buckets for queue in bucket.jobs.values() for item in queue),
            key=lambda item: item.arrived,
        )
        self.buckets = [Bucket() for _ in range(len(policy.bucket_edges) + 1)]
        for item in waiting:
            self.buckets[bisect_left(policy.bucket_edges, item.length)].add(item)

    def add(self, item: Item) -> None:
        if not self.size:
            self.waiting_since = item.arrived
        self.buckets[bisect_left(self.policy.bucket_edges, item.length)].add(item)
        self.size += 1

    def oldest_arrival(self) -> float:
        return min(bucket.oldest_arrival() for bucket in self.buckets if bucket.size)

    def deadline(self) -> float:
        return self.oldest_arrival() + self.policy.max_wait_s

    def starving(self, now: float) -> bool:
        """Has this lane gone ``max_delay_s`` with items waiting and no batch served?

        Measured from the later of the last batch and the moment items began to wait, not from the
        oldest item's arrival: a lane working through its own backlog is served, not starved, and
        must not jump ahead of urgent lanes at every boundary.
        """
        bound = self.policy.max_delay_s
        return bound is not None and now - max(self.waiting_since, self.served_at) >= bound

    def full_bucket(self) -> int | None:
        """The bucket (oldest first) that already fills a batch by count or by token budget."""
        full = [i for i, bucket in enumerate(self.buckets) if bucket.is_full(self.policy)]
        return min(full, key=lambda i: self.buckets[i].oldest_arrival(), default=None)

    def is_ready(self, now: float) -> bool:
        return now >= self.deadline() or self.full_bucket() is not None

    def oldest_bucket(self) -> Bucket:
        return min((b for b in self.buckets if b.size), key=Bucket.oldest_arrival)

    def take(self, now: float) -> list[Item]:
        """A batch: when T is up, the oldest item's bucket topped up from others; else a full bucket.

        Topping up takes the nearest buckets first (shorter before longer at equal distance), so a
        deadline batch is as long as N and the token budget allow with as little padding as possible.
        """
        seed = None if now >= self.deadline() else self.full_bucket()
        if seed is None:
            seed = min(
                (i for i, b in enumerate(self.buckets) if b.size),
                key=lambda i: self.buckets[i].oldest_arrival(),
            )
            order = sorted(range(len(self.buckets)), key=lambda i: (abs(i - seed), i > seed))
        else:
            order = [seed]
        taken: list[Item] = []
        for i in order:
            self.buckets[i].take_into(taken, self.policy)
            if len(taken) >= self.policy.max_batch_size:
                break
        self.served_at = now
        self.size -= len(taken)
        return taken


class Scheduler:
    """Lanes of waiting items; ``next_batch`` decides what the model runs next."""

    def __init__(self, policy_for: Callable[[LaneKey], LanePolicy]) -> None:
        self._policy_for = policy_for
        self._lanes: dict[LaneKey, Lane] = {}
        self._caps: dict[str, int | None] = {}

    def add(self, model: str, priority: str, item: Item) -> None:
        key = (model, priority)
        lane = self._lanes.get(key)
        if lane is None:
            lane = self._lanes[key] = Lane(key, self._policy_for(key))
            lane.cap_size(self._caps.get(model))
        lane.add(item)

    def cap_size(self, model: str, cap: int | None) -> None:
        """Hold every lane of ``model`` to batches of at most ``cap`` items (None: back to N)."""
        self._caps[model] = cap
        for (lane_model, _), lane in self._lanes.items():
            if lane_model == model:
                lane.cap_size(cap)

    def reconfigure(self, model: str) -> None:
        """Ask ``policy_for`` again for every lane of ``model``: its limits changed while items wait."""
        for (lane_model, priority), lane in self._lanes.items():
            if lane_model == model:
                lane.reconfigure(self._policy_for((lane_model, priority)), self._caps.get(model))

    def __len__(self) -> int:
        return sum(lane.size for lane in self._lanes.values())

    def waiting(self, priority: str) -> int:
        return sum(lane.size for key, lane in self._lanes.items() if key[1] == priority)

    def next_batch(self, now: float, *, flush: bool = False) -> Batch | None:
        """The batch to run now, or None if no lane is ready. ``flush`` treats every lane as ready.

        The most urgent ready lane goes first, except that a lane whose oldest item waited past its
        starvation bound goes before all lanes that have not (oldest first among those). Lanes of
        continuously batched models are left to ``admit_next``.
        """
        ready = [lane for lane in self._waiting(continuous=False) if flush or lane.is_ready(now)]
        if not ready:
            return None
        lane = _most_urgent(ready, now)
        return Batch(lane.key, tuple(lane.take(now)), now)

    def admit_next(self, model: str, now: float, fits: Callable[[int], bool]) -> Item | None:
        """The next item to join ``model``'s running batch (continuous batching), if ``fits`` its length.

        The lane is chosen as for batches (urgency, then aging); within it, the oldest item goes.
        """
        lanes = [lane for lane in self._waiting(continuous=True) if lane.key[0] == model]
        if not lanes:
            return None
        lane = _most_urgent(lanes, now)
        bucket = lane.oldest_bucket()
        if not fits(bucket.peek_oldest().length):
            return None
        lane.served_at = now
        lane.size -= 1
        return bucket.pop_oldest()

    def waiting_for(self, model: str) -> int:
        return sum(lane.size for key, lane in self._lanes.items() if key[0] == model)

    def next_deadline(self) -> float | None:
        """When the earliest lane becomes ready by waiting alone, or None when nothing waits."""
        return min((lane.deadline() for lane in self._waiting(continuous=False)), default=None)

    def _waiting(self, *, continuous: bool) -> Iterator[Lane]:
        return (lane for lane in self._lanes.values() if lane.size and lane.policy.continuous == continuous)


def _most_urgent(lanes: list[Lane], now: float) -> Lane:
    """A lane past its starvation bound first (the longest waiting of those), else the lowest rank."""
    starving = [lane for lane in lanes if lane.starving(now)]
    if starving:
        return min(starving, key=Lane.oldest_arrival)
    return min(lanes, key=lambda lane: (lane.policy.rank, lane.oldest_arrival()))
