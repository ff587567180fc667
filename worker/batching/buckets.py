"""What the scheduler orders (an item waiting in a lane), and one length bucket of a lane: items queued per
job, taken in turns within N and a token budget.

Every operation costs O(items taken · log jobs), never a scan of the jobs held: a worker may hold tens of
thousands of single-item jobs, and the scheduler runs under the lock the prepare thread also needs. Pure:
items and numbers only; never imports an edge of the system.
"""

from __future__ import annotations

import heapq
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass
from itertools import count
from operator import attrgetter
from typing import Any

from worker.batching.policy import LanePolicy

LaneKey = tuple[str, str]  # (model, priority)


# Not frozen: a frozen dataclass's __init__ costs several times a plain one, and the prepare thread makes one
# Item per item received (a 200,000-item job makes 200,000). Nothing changes an Item after it is made.
@dataclass(slots=True, unsafe_hash=True)
class Item:
    job_id: str
    index: int
    length: int  # cost in tokens (1 for models without a notion of length)
    arrived: float  # clock reading when the item entered the worker
    ref: Any = None  # the runtime's own handle (payload, message); opaque here


class Bucket:
    def __init__(self) -> None:
        # Each job's waiting items in arrival order; jobs least recently served first (the turn order).
        self.jobs: OrderedDict[str, deque[Item]] = OrderedDict()
        self.size = 0
        self._heads: list[tuple[float, int, Item]] = []  # each job's first item, by arrival; stale ones stay
        self._lengths = _Lengths()
        self._seq = count()

    @property
    def longest(self) -> int:
        """The longest waiting item's length."""
        return self._lengths.most()

    def add(self, item: Item) -> None:
        queue = self.jobs.get(item.job_id)
        if queue is None:
            queue = self.jobs[item.job_id] = deque()
        queue.append(item)
        if len(queue) == 1:
            heapq.heappush(self._heads, (item.arrived, next(self._seq), item))
        self.size += 1
        self._lengths.add(item.length)

    def add_run(self, items: list[Item]) -> None:
        """Add items of ONE job, in arrival order (a message's items): one queue lookup and one heap push
        for the whole run, not one per item."""
        if len(items) < 2:
            for item in items:
                self.add(item)
            return
        first = items[0]
        queue = self.jobs.get(first.job_id)
        if queue is None:
            queue = self.jobs[first.job_id] = deque()
        if not queue:
            heapq.heappush(self._heads, (first.arrived, next(self._seq), first))
        queue.extend(items)
        self.size += len(items)
        self._lengths.add_many(list(map(_LENGTH, items)))

    def oldest(self) -> Item:
        """The item that has waited longest (every job's items wait in arrival order: it heads its job)."""
        while True:
            _, _, item = self._heads[0]
            queue = self.jobs.get(item.job_id)
            if queue and queue[0] is item:
                return item
            heapq.heappop(self._heads)  # that job's head has moved on since

    def is_full(self, policy: LanePolicy) -> bool:
        if self.size >= policy.max_batch_size:
            return True
        budget = policy.max_batch_tokens
        return budget is not None and self.size * self.longest >= budget

    def take_into(self, batch: list[Item], policy: LanePolicy) -> None:
        """Move items into ``batch``, one per job in turn, while N and the token budget allow.

        The job holding the oldest item goes first (so the item whose deadline fired always rides), unless
        the job first in turn holds one as old; then jobs in turn order. Jobs that gave an item move to the
        back, so the next batch starts with the jobs not reached. An item longer than the whole budget
        still runs, alone.
        """
        longest = max((item.length for item in batch), default=0)
        if len(self.jobs) == 1:  # one job: its turns are all its own, so take its items as one run
            self._take_run(batch, longest, policy)
        else:
            self._take_turns(batch, longest, policy)

    def _take_turns(self, batch: list[Item], longest: int, policy: LanePolicy) -> None:
        while self.size and len(batch) < policy.max_batch_size:
            served: list[str] = []
            for job_id in self._turns(len(batch), policy.max_batch_size):
                length = self.jobs[job_id][0].length
                if not _fits(batch, longest, length, policy.max_batch_tokens):
                    self._requeue(served)
                    return
                batch.append(self._pop_head(job_id))
                longest = max(longest, length)
                served.append(job_id)
            self._requeue(served)

    def _take_run(self, batch: list[Item], longest: int, policy: LanePolicy) -> None:
        """``take_into`` for a bucket holding one job: what its rounds would take, item by item in order,
        with one heap push for the whole run."""
        job_id, queue = next(iter(self.jobs.items()))
        room = policy.max_batch_size - len(batch)
        budget = policy.max_batch_tokens
        taken: list[Item] = []
        if budget is None:
            taken = [queue.popleft() for _ in range(min(room, len(queue)))]
        else:
            count = len(batch)
            while queue and len(taken) < room:
                length = queue[0].length
                if count and max(longest, length) * (count + 1) > budget:
                    break
                taken.append(queue.popleft())
                longest, count = max(longest, length), count + 1
        batch.extend(taken)
        self.size -= len(taken)
        self._lengths.remove_many(list(map(_LENGTH, taken)))
        if queue:
            if taken:
                heapq.heappush(self._heads, (queue[0].arrived, next(self._seq), queue[0]))
        else:
            del self.jobs[job_id]

    def pop_oldest(self) -> Item:
        """The oldest item, taken alone (continuous batching admits one at a time)."""
        job_id = self.oldest().job_id
        item = self._pop_head(job_id)
        self._requeue([job_id])
        return item

    def _turns(self, taken: int, most: int) -> list[str]:
        """The jobs to serve one item each in this round: the oldest item's job first, then turn order."""
        first = self.oldest().job_id
        front = next(iter(self.jobs))
        if self.jobs[front][0].arrived <= self.jobs[first][0].arrived:
            first = front
        turns = [first]
        for job_id in self.jobs:
            if len(turns) >= most - taken:
                break
            if job_id != first:
                turns.append(job_id)
        return turns

    def _pop_head(self, job_id: str) -> Item:
        queue = self.jobs[job_id]
        item = queue.popleft()
        self.size -= 1
        self._lengths.remove(item.length)
        if queue:
            heapq.heappush(self._heads, (queue[0].arrived, next(self._seq), queue[0]))
        return item

    def _requeue(self, served: list[str]) -> None:
        for job_id in served:
            if self.jobs[job_id]:
                self.jobs.move_to_end(job_id)
            else:
                del self.jobs[job_id]


_LENGTH = attrgetter("length")


class _Lengths:
    """A multiset of lengths that answers its largest in O(log n) amortized (a heap, pruned lazily)."""

    def __init__(self) -> None:
        self._heap: list[int] = []  # negated lengths
        self._count: Counter[int] = Counter()

    def add(self, length: int) -> None:
        if not self._count[length]:
            heapq.heappush(self._heap, -length)
        self._count[length] += 1

    def add_many(self, lengths: list[int]) -> None:
        for length in set(lengths):
            if not self._count[length]:
                heapq.heappush(self._heap, -length)
        self._count.update(lengths)

    def remove(self, length: int) -> None:
        self._count[length] -= 1

    def remove_many(self, lengths: list[int]) -> None:
        # Counted first (in C), then subtracted per distinct length: ``subtract`` of a list is a Python
        # loop per element, and a batch of a thousand items has a few distinct lengths.
        self._count.subtract(Counter(lengths))

    def most(self) -> int:
        while self._heap and not self._count[-self._heap[0]]:
            heapq.heappop(self._heap)
        return -self._heap[0] if self._heap else 0


def _fits(batch: list[Item], longest: int, length: int, budget: int | None) -> bool:
    if budget is None or not batch:
        return True
    return max(longest, length) * (len(batch) + 1) <= budget
