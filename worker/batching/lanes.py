"""One lane's waiting items (a model at one priority), in length buckets: when it is ready, what its next
batch holds, and whether it is starving.

Pure: items, numbers and a clock reading; never imports an edge of the system.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import replace

from worker.batching.buckets import Bucket, Item, LaneKey
from worker.batching.policy import LanePolicy


class LaneQueue:
    """The items of one model and priority, in length buckets, under the lane's policy."""

    def __init__(self, key: LaneKey, configured: LanePolicy, cap: int | None = None) -> None:
        self.key = key
        self.configured = configured
        self.policy = configured  # the configured policy, with N lowered while a size cap holds
        self.buckets = [Bucket() for _ in range(len(configured.bucket_edges) + 1)]
        self.size = 0  # kept, not summed: it is read once per item added
        self.waiting_since = self.served_at = float("-inf")
        self.cap_size(cap)

    def cap_size(self, cap: int | None) -> None:
        """Hold batches to at most ``cap`` items (None: the configured N)."""
        size = self.configured.max_batch_size if cap is None else min(cap, self.configured.max_batch_size)
        self.policy = replace(self.configured, max_batch_size=size)

    def reconfigure(self, configured: LanePolicy, cap: int | None) -> None:
        """A new policy (the settings or tuned limits changed); waiting items keep their buckets while the
        edges stay the same, and are sorted into the new ones otherwise."""
        waiting = self._drain() if configured.bucket_edges != self.configured.bucket_edges else []
        self.configured = configured
        self.cap_size(cap)
        if waiting:
            self.buckets = [Bucket() for _ in range(len(configured.bucket_edges) + 1)]
            for item in waiting:
                self.add(item)

    def add(self, item: Item) -> None:
        if not self.size:
            self.waiting_since = item.arrived
        self.buckets[bisect_left(self.policy.bucket_edges, item.length)].add(item)
        self.size += 1

    def add_run(self, items: list[Item]) -> None:
        """Add items of one job in arrival order (a message's items), each run of one bucket at once."""
        if not items:
            return
        if not self.size:
            self.waiting_since = items[0].arrived
        edges = self.policy.bucket_edges
        if not edges:
            self.buckets[0].add_run(items)
        else:
            runs: dict[int, list[Item]] = {}
            for item in items:
                runs.setdefault(bisect_left(edges, item.length), []).append(item)
            for index, run in runs.items():
                self.buckets[index].add_run(run)
        self.size += len(items)

    def oldest_arrival(self) -> float:
        return min(bucket.oldest().arrived for bucket in self.buckets if bucket.size)

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

    def is_ready(self, now: float) -> bool:
        return now >= self.deadline() or self._full_bucket() is not None

    def take(self, now: float) -> list[Item]:
        """A batch: when T is up, the oldest item's bucket topped up from others; else a full bucket.

        Topping up takes the nearest buckets first (shorter before longer at equal distance), so a
        deadline batch is as long as N and the token budget allow with as little padding as possible.
        """
        seed = None if now >= self.deadline() else self._full_bucket()
        if seed is None:
            seed = self._oldest_bucket()
            order = sorted(range(len(self.buckets)), key=lambda i: (abs(i - seed), i > seed))
        else:
            order = [seed]
        taken: list[Item] = []
        for i in order:
            self.buckets[i].take_into(taken, self.policy)
            if len(taken) >= self.policy.max_batch_size:
                break
        self._served(now, len(taken))
        return taken

    def pop_oldest(self, now: float) -> Item:
        """The lane's oldest item, alone (continuous batching admits one at a time)."""
        item = self.buckets[self._oldest_bucket()].pop_oldest()
        self._served(now, 1)
        return item

    def peek_oldest(self) -> Item:
        return self.buckets[self._oldest_bucket()].oldest()

    def _served(self, now: float, items: int) -> None:
        self.served_at = now
        self.size -= items

    def _full_bucket(self) -> int | None:
        """The bucket (oldest first) that already fills a batch by count or by token budget."""
        full = [i for i, bucket in enumerate(self.buckets) if bucket.is_full(self.policy)]
        return min(full, key=lambda i: self.buckets[i].oldest().arrived, default=None)

    def _oldest_bucket(self) -> int:
        return min(
            (i for i, b in enumerate(self.buckets) if b.size), key=lambda i: self.buckets[i].oldest().arrived
        )

    def _drain(self) -> list[Item]:
        items: list[Item] = []
        for bucket in self.buckets:
            while bucket.size:
                items.append(bucket.pop_oldest())
        self.size = 0
        return sorted(items, key=lambda item: item.arrived)
