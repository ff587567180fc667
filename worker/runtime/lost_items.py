"""Ending items whose messages no longer exist: every item still without an outcome of such a job ends with a
``lost:`` error, so no job (and no `batchwork run` waiting on one) waits forever for messages that are gone.

Two ways to learn of it, one way to end it. After Redis restarted empty (the broker epoch), every older
unfinished job. And, whatever removed them (``celery purge``, a DEL, a failover), the jobs a census of
messages (broker/census.py) has not seen in queues or the held set for ``lost_grace_s``: one worker takes the
census every period. It runs on timer threads of its own, never on the engine's threads.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

from worker.broker.census import MessageCensus
from worker.store.ports import WorkerStore
from worker.store.values import JobSpec

log = logging.getLogger(__name__)

LOST_ERROR = "lost: the broker restarted and dropped this item before it ran; submit it again"
GONE_ERROR = "lost: no message of this job is left in the broker (purged or removed); submit it again"
# Unfinished jobs one census looks at, oldest first; younger ones wait for the next census.
JOBS_PER_CENSUS = 1000


def census_period_s(grace_s: float) -> float:
    """How often the census is taken: twice per grace period, at most once a second."""
    return max(1.0, grace_s / 2)


class LostItems:
    def __init__(self, store: WorkerStore, census: MessageCensus | None = None) -> None:
        self.store = store
        self.census = census
        self._stopping = threading.Event()

    def after(self, grace_s: float) -> None:
        """The broker came back empty (restarted without persistence): what it held is gone.

        After a grace period, in which workers finish and store the items they already hold, every
        item of a job created before now that still has no outcome ends with a "lost" error, so no
        job waits forever for messages that no longer exist.
        """
        cutoff = datetime.now(UTC)
        log.warning("the broker lost its messages; unfinished items end as lost in %.0f s", grace_s)
        timer = threading.Timer(grace_s, self._end_older, args=(cutoff,))
        timer.daemon = True
        timer.start()

    def watch(self, holder: str) -> None:
        """Take part in the census (one worker takes it each period) until ``stop``."""
        if self.census is None:
            return
        thread = threading.Thread(target=self._watch, args=(holder,), name="batchwork-census", daemon=True)
        thread.start()

    def stop(self) -> None:
        self._stopping.set()

    def take_census(self, holder: str) -> int:
        """If it is this worker's turn: end the jobs whose messages the census found gone; how many."""
        census = self.census
        if census is None or not census.take_turn(holder, census_period_s(census.grace_s)):
            return 0
        cutoff = datetime.now(UTC) - timedelta(seconds=census.grace_s)
        jobs = {job.job_id: job for job in self.store.unfinished_jobs(cutoff, limit=JOBS_PER_CENSUS)}
        lost = census.lost([(job.job_id, job.priority) for job in jobs.values()])
        specs = [jobs[job_id] for job_id in lost.sql]
        specs += [_spec(job_id, record) for job_id, record in lost.pending.items()]
        self._end(specs, GONE_ERROR)
        census.forget([spec.job_id for spec in specs])
        return len(specs)

    def _watch(self, holder: str) -> None:
        assert self.census is not None
        while not self._stopping.wait(census_period_s(self.census.grace_s)):
            try:
                self.take_census(holder)
            except Exception as exc:  # Redis or the database away: the next period tries again
                log.warning("could not take the census of messages: %s", exc)

    def _end_older(self, cutoff: datetime) -> None:
        for attempt in range(10):
            try:
                self._end(self.store.unfinished_jobs(created_before=cutoff), LOST_ERROR)
                return
            except Exception as exc:
                log.warning("could not end lost items (%s); attempt %d", exc, attempt + 1)
                time.sleep(5)

    def _end(self, jobs: Sequence[JobSpec], error: str) -> None:
        """Every item of ``jobs`` without an outcome yet ends with ``error`` (a job never recorded in SQL gets
        its row from its spec)."""
        for job in jobs:
            ended = self.store.end_missing(job, error)
            if ended:
                log.warning("job %s: %d items ended as lost", job.job_id, ended)


def _spec(job_id: str, record: dict[str, str]) -> JobSpec:
    created = datetime.fromisoformat(record["created_at"]).timestamp() if "created_at" in record else None
    return JobSpec(job_id, record["model"], record["priority"], int(record["total"]), created)
