"""Cancellation: a cancelled job's items that have not run yet never run; each ends as "cancelled".

The watch thread asks the store once a second which held jobs were cancelled, so the run thread only reads
a set and never waits on the database. While no held job is cancelled the hook is idle: the engine does not
call it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from worker.runtime.deliveries import Holdings, Pack
from worker.runtime.hooks import Hook, Run
from worker.store.ports import WorkerStore

log = logging.getLogger(__name__)

CANCEL_CHECK_S = 1.0


class Cancellation(Hook):
    def __init__(self, store: WorkerStore, holdings: Holdings, every_s: float = CANCEL_CHECK_S) -> None:
        self.store = store
        self.holdings = holdings
        self.every_s = every_s
        # Replaced whole, never changed in place: the run thread reads it without a lock.
        self.cancelled: frozenset[str] = frozenset()
        self.idle = True
        self._stop = threading.Event()

    def before_batch(self, runs: Sequence[Run]) -> dict[Pack, str]:
        cancelled = self.cancelled
        if not cancelled:
            return {}
        return {
            pack: "cancelled"
            for pack, _ in runs
            if (call := pack.delivery.call) is not None and call.job_id in cancelled
        }

    # -- the watch thread -----------------------------------------------------------------------

    def loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self.refresh()

    def refresh(self) -> None:
        try:
            self.cancelled = frozenset(self.store.cancelled(self.holdings.jobs()))
            self.idle = not self.cancelled
        except Exception as exc:  # a database outage: keep the last answer, ask again next time
            log.warning("could not check for cancelled jobs: %s", exc)

    def stop(self) -> None:
        self._stop.set()
