"""Which items were running when a worker died, so one poison input cannot crash-loop a fleet.

A message whose worker vanished before acknowledging it comes back marked as lost. Its items are suspects:
before a batch holding any runs, each suspect's death count goes up by one in Redis, and down again when the
batch returns (the writes the run thread waits for, and only on this rare path): only the batch in flight
when a worker dies keeps its counts. A count is deleted once its item's outcome is committed. A suspect
that has seen a death, or whose next death would be its last, runs alone, so a crash names it; one that has
seen ``max_deliveries - 1`` is not run again but stored with an error naming why (a worker died running it
that many times, plus the first, unjournaled run). Items of first deliveries are never journaled: the common
path does no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence

import redis

from worker.broker.keys import Keys

DEATHS_ERROR = (
    "the worker running this item died {deaths} times (a crash, os._exit or the out-of-memory killer); "
    "it is not run again (BATCHWORK_MAX_DELIVERIES={limit})"
)


class Journal:
    def __init__(self, client: redis.Redis, keys: Keys) -> None:
        self.client = client
        self.keys = keys

    def deaths(self, job_id: str, indices: Sequence[int]) -> list[int]:
        """How often a worker died while each of these items of the job was running (journaled)."""
        if not indices:
            return []
        counts = self.client.hmget(self.keys.item_deaths, [f"{job_id}:{index}" for index in indices])
        return [int(count) if count else 0 for count in counts]

    def starting(self, items: Sequence[tuple[str, int]]) -> None:
        """These suspects are about to run: count a death for each now, taken back when the run returns."""
        self._add(items, 1)

    def finished(self, items: Sequence[tuple[str, int]]) -> None:
        """These suspects ran and returned: the death counted when they started did not happen."""
        self._add(items, -1)

    def _add(self, items: Sequence[tuple[str, int]], amount: int) -> None:
        if items:
            pipe = self.client.pipeline(transaction=False)
            for job_id, index in items:
                pipe.hincrby(self.keys.item_deaths, f"{job_id}:{index}", amount)
            pipe.execute()

    def stored(self, items: Sequence[tuple[str, int]]) -> None:
        """These suspects' outcomes are committed: no death counts against them (the store thread's call)."""
        if items:
            self.client.hdel(self.keys.item_deaths, *(f"{job_id}:{index}" for job_id, index in items))
