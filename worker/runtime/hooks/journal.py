"""Which items were running when a worker died, so one poison input cannot crash-loop a fleet.

A message whose worker vanished before acknowledging it comes back marked as lost. Its items are suspects:
before a batch holding any runs, each suspect's death count goes up by one in Redis, and down again when the
batch returns (the writes the run thread waits for, and only on this rare path): only the batch in flight
when a worker dies keeps its counts. A count is deleted once its item's outcome is committed. A suspect
that has seen ALONE_AFTER deaths, or whose next death would be its last, runs alone, so a crash names it;
one that has seen ``max_deliveries - 1`` is not run again but stored with an error naming why (a worker died
running it that many times, plus the first, unjournaled run). Items of first deliveries are never journaled:
the engine calls this hook for redelivered messages only, so the common path does no I/O and never enters
this module.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import redis

from worker.broker.keys import Keys
from worker.runtime.deliveries import Delivery, Pack, ResultsToStore
from worker.runtime.hooks import Admission, Hook, Ran, Run, Scope

log = logging.getLogger(__name__)

# Deaths after which a suspect runs alone. One death is as often a fleet's churn (a preempted node, a
# deploy, the OOM killer answering the whole batch) as a poison input, and running every item of the batch
# that died alone serialises its recovery on one worker (the chaos test: 24 items at 0.3 s each, while the
# other workers idled). A second death while running the same item is a pattern. With the default cap (3)
# the last allowed run comes first and is alone either way.
ALONE_AFTER = 2

DEATHS_ERROR = (
    "the worker running this item died {deaths} times (a crash, os._exit or the out-of-memory killer); "
    "it is not run again (BATCHWORK_MAX_DELIVERIES={limit})"
)


class Journal:
    """The death counts of suspect items, in Redis."""

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


def placement(deaths: int, max_deliveries: int) -> str:
    """Where a suspect that has seen ``deaths`` goes: "ended" (stored with an error, not run again),
    "alone" (its own batch, so a crash names it) or "batch" (with the others)."""
    if deaths >= max_deliveries - 1:
        return "ended"
    if deaths >= ALONE_AFTER or deaths == max_deliveries - 2:
        return "alone"
    return "batch"


class PoisonItems(Hook):
    """The journal at the engine's hook points: suspects past the cap end at once, those near it or seen
    dying twice run alone, and every suspect's count goes up while it runs and is deleted once its outcome
    is stored."""

    scope: Scope = "redelivered"

    def __init__(self, journal: Journal, max_deliveries: int) -> None:
        self.journal = journal
        self.max_deliveries = max_deliveries

    def received(self, delivery: Delivery, admission: Admission) -> None:
        """Prepare thread (a Redis read, for redelivered messages only)."""
        call = delivery.call
        if not delivery.lost or call is None:
            return
        positions = range(len(call.inputs))
        try:
            deaths = self.journal.deaths(call.job_id, [call.index(p) for p in positions])
        except Exception as exc:
            # Redis failed the read: every suspect runs alone, as if it had died before. A crash still names
            # its item, and the cap counts one delivery late; raising would leave the message held for good.
            log.warning(
                "could not read the death counts of %d suspect items (%s): they run alone",
                len(positions),
                exc,
            )
            admission.alone.update(positions)
            return
        limit = self.max_deliveries
        for position, count in enumerate(deaths):
            placed = placement(count, limit)
            if placed == "ended":
                admission.ended[position] = DEATHS_ERROR.format(deaths=count + 1, limit=limit)
            elif placed == "alone":
                admission.alone.add(position)

    def before_batch(self, runs: Sequence[Run]) -> dict[Pack, str]:
        """Run thread: count a death for each suspect about to run. The run thread waits for this write, on
        this rare path only: it must be durable before the crash it may witness."""
        self._count(runs, starting=True)
        return {}

    def after_batch(self, runs: Sequence[Run], ran: Ran | None) -> None:
        """Run thread: the suspects returned; take back the deaths counted when they started."""
        self._count(runs, starting=False)

    def _count(self, runs: Sequence[Run], *, starting: bool) -> None:
        items = [(item.job_id, item.index) for pack, mine in runs if pack.suspect for item in mine]
        if not items:
            return
        try:
            (self.journal.starting if starting else self.journal.finished)(items)
        except Exception as exc:  # run anyway: a missed count only delays the cap by one delivery
            log.warning("could not journal %d suspect items: %s", len(items), exc)

    def after_store(self, write: ResultsToStore) -> None:
        """Store thread: the stored suspects' counts go (before their messages are acknowledged)."""
        suspects: list[tuple[str, int]] = []
        indices, start = write.columns.indices, 0
        for delivery, count in write.runs:
            if delivery.lost:
                job_id = write.columns.job_ids[start]
                suspects += [(job_id, index) for index in indices[start : start + count]]
            start += count
        if not suspects:
            return
        try:
            self.journal.stored(suspects)
        except Exception as exc:  # a stale count only makes an item run alone once more
            log.warning("could not clear the death counts of %d stored items: %s", len(suspects), exc)
