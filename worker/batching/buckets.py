"""One length bucket of a lane: items queued per job, taken in turns within N and a token budget.

Pure: items and numbers only; never imports an edge of the system.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from worker.batching.policy import LanePolicy
    from worker.batching.scheduler import Item


class Bucket:
    def __init__(self) -> None:
        self.jobs: OrderedDict[str, deque[Item]] = OrderedDict()
        self.size = 0
        self.longest = 0  # the longest waiting item's length

    def add(self, item: Item) -> None:
        queue = self.jobs.get(item.job_id)
        if queue is None:
            queue = self.jobs[item.job_id] = deque()
        queue.append(item)
        self.size += 1
        self.longest = max(self.longest, item.length)

    def oldest_arrival(self) -> float:
        return min(queue[0].arrived for queue in self.jobs.values())

    def is_full(self, policy: LanePolicy) -> bool:
        if self.size >= policy.max_batch_size:
            return True
        budget = policy.max_batch_tokens
        return budget is not None and self.size * self.longest >= budget

    def take_into(self, batch: list[Item], policy: LanePolicy) -> None:
        """Move items into ``batch``, one per job in turn, while N and the token budget allow.

        The job holding the oldest item goes first, so the item whose deadline fired always rides.
        Jobs that gave an item move to the back; the next batch starts with the jobs not reached.
        An item longer than the whole budget still runs, alone.
        """
        if not self.size:
            return
        self._rotate_to_oldest()
        longest = max((item.length for item in batch), default=0)
        while self.jobs and len(batch) < policy.max_batch_size:
            served: list[str] = []
            over_budget = False
            for job_id, queue in self.jobs.items():
                if len(batch) == policy.max_batch_size:
                    break
                if not _fits(batch, longest, queue[0].length, policy.max_batch_tokens):
                    over_budget = True
                    break
                item = queue.popleft()
                batch.append(item)
                longest = max(longest, item.length)
                served.append(job_id)
            self._requeue(served)
            if over_budget:
                break
        self.longest = max((item.length for queue in self.jobs.values() for item in queue), default=0)

    def peek_oldest(self) -> Item:
        return min((queue[0] for queue in self.jobs.values()), key=lambda item: item.arrived)

    def pop_oldest(self) -> Item:
        self._rotate_to_oldest()
        job_id, queue = next(iter(self.jobs.items()))
        item = queue.popleft()
        self._requeue([job_id])
        self.longest = max((i.length for q in self.jobs.values() for i in q), default=0)
        return item

    def _rotate_to_oldest(self) -> None:
        oldest = min(self.jobs, key=lambda job_id: self.jobs[job_id][0].arrived)
        while next(iter(self.jobs)) != oldest:
            self.jobs.move_to_end(next(iter(self.jobs)))

    def _requeue(self, served: list[str]) -> None:
        for job_id in served:
            self.size -= 1
            if self.jobs[job_id]:
                self.jobs.move_to_end(job_id)
            else:
                del self.jobs[job_id]


def _fits(batch: list[Item], longest: int, length: int, budget: int | None) -> bool:
    if budget is None or not batch:
        return True
    return max(longest, length) * (len(batch) + 1) <= budget
