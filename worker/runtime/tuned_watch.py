"""Tuned batching limits inside a worker: read at start, re-read every BATCHWORK_TUNED_REFRESH_S on a
thread of their own, and out-of-memory sizes recorded from that same thread.

The run thread only reads the in-memory snapshot (a dict replaced whole, never changed in place); it must
never wait on SQL here.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from pydantic import ValidationError

from worker.settings import BatchingSettings
from worker.store.ports import TunedStore

log = logging.getLogger(__name__)

NONE = BatchingSettings()


class TunedLimitsWatcher:
    def __init__(
        self,
        store: TunedStore,
        device_kind: str,
        refresh_s: float,
        worker_name: str,
        on_change: Callable[[set[str]], None],
    ) -> None:
        self.store = store
        self.device_kind = device_kind
        self.refresh_s = refresh_s
        self.worker_name = worker_name
        self.on_change = on_change
        self._snapshot: dict[str, BatchingSettings] = {}
        self._out_of_memory: queue.SimpleQueue[tuple[str, int] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="batchwork-tuned", daemon=True)

    def limits(self, model: str) -> BatchingSettings:
        """The tuned limits of ``model`` on this device kind (empty when none were applied)."""
        return self._snapshot.get(model, NONE)

    def start(self) -> None:
        """Read once before the first lane forms, so a fresh worker starts with the tuned limits."""
        self._refresh(notify=False)
        self._thread.start()

    def stop(self) -> None:
        self._out_of_memory.put(None)
        self._thread.join(5)

    def record_out_of_memory(self, model: str, size: int) -> None:
        """Called on the run thread: only queues; the SQL runs on this watcher's thread."""
        self._out_of_memory.put((model, size))

    def _loop(self) -> None:
        while True:
            try:
                failed = self._out_of_memory.get(timeout=self.refresh_s)
            except queue.Empty:
                self._refresh(notify=True)
                continue
            if failed is None:
                return
            self._record(*failed)

    def _record(self, model: str, size: int) -> None:
        try:
            self.store.record_out_of_memory(model, self.device_kind, size, self.worker_name)
        except Exception as exc:  # monitoring only: the backoff itself already holds the size down
            log.warning("could not record that %s ran out of memory at %d items: %s", model, size, exc)

    def _refresh(self, *, notify: bool) -> None:
        try:
            rows = self.store.rows(device_kind=self.device_kind)
        except Exception as exc:  # a database outage keeps the limits the worker has
            log.warning("could not read tuned limits: %s", exc)
            return
        fresh: dict[str, BatchingSettings] = {}
        for row in rows:
            if not row.batching:
                continue
            try:
                fresh[row.model] = BatchingSettings.model_validate(row.batching)
            except ValidationError as exc:
                log.warning("ignoring the tuned limits of %s: %s", row.model, exc)
        changed = {m for m in fresh.keys() | self._snapshot.keys() if fresh.get(m) != self._snapshot.get(m)}
        self._snapshot = fresh
        if changed:
            log.info("tuned limits of %s on %s: %s", ", ".join(sorted(changed)), self.device_kind, fresh)
            if notify:
                self.on_change(changed)
