"""The watch thread: once a second, asks the store which held jobs were cancelled, so the run thread only
reads a set and never waits on the database.
"""

from __future__ import annotations

import logging
import threading

from worker.runtime.deliveries import Holdings
from worker.runtime.ports import WorkerStore

log = logging.getLogger(__name__)

CANCEL_CHECK_S = 1.0


class CancelWatch:
    def __init__(self, store: WorkerStore, holdings: Holdings, every_s: float = CANCEL_CHECK_S) -> None:
        self.store = store
        self.holdings = holdings
        self.every_s = every_s
        # Replaced whole, never changed in place: the run thread reads it without a lock.
        self.cancelled: frozenset[str] = frozenset()
        self._stop = threading.Event()

    def loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self.refresh()

    def refresh(self) -> None:
        try:
            self.cancelled = frozenset(self.store.cancelled(self.holdings.jobs()))
        except Exception as exc:  # a database outage: keep the last answer, ask again next time
            log.warning("could not check for cancelled jobs: %s", exc)

    def stop(self) -> None:
        self._stop.set()
