"""Ending items the broker lost: after Redis restarted empty, every item still without an outcome of a job
recorded in SQL ends with a ``lost:`` error, so no job waits forever for messages that no longer exist.

It runs on a timer thread of its own, never on the engine's threads.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import UTC, datetime

from worker.store.results import ResultStore
from worker.store.values import ItemOutcome

log = logging.getLogger(__name__)

LOST_ERROR = "lost: the broker restarted and dropped this item before it ran; submit it again"


class LostItems:
    def __init__(self, store: ResultStore) -> None:
        self.store = store

    def after(self, grace_s: float) -> None:
        """The broker came back empty (restarted without persistence): what it held is gone.

        After a grace period, in which workers finish and store the items they already hold, every
        item of a job created before now that still has no outcome ends with a "lost" error, so no
        job waits forever for messages that no longer exist.
        """
        cutoff = datetime.now(UTC)
        log.warning("the broker lost its messages; unfinished items end as lost in %.0f s", grace_s)
        timer = threading.Timer(grace_s, self._end, args=(cutoff,))
        timer.daemon = True
        timer.start()

    def _end(self, cutoff: datetime) -> None:
        for attempt in range(10):
            try:
                for job in self.store.unfinished_jobs(created_before=cutoff):
                    missing = self.store.missing_indices(job.job_id, job.total)
                    outcomes = [ItemOutcome(job.job_id, index, None, error=LOST_ERROR) for index in missing]
                    if outcomes:
                        self.store.write_batch(None, outcomes, [job])
                        log.warning("job %s: %d items ended as lost", job.job_id, len(outcomes))
                return
            except Exception as exc:
                log.warning("could not end lost items (%s); attempt %d", exc, attempt + 1)
                time.sleep(5)
