"""A batching worker inside the calling process, for `batchwork run` with no broker configured.

It is the same Celery worker and engine as `batchwork worker`, on the in-memory broker, in a
background thread; it must only be used with ``memory://``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from worker.errors import SetupError


@contextmanager
def embedded_worker(app: Any, timeout_s: float = 120.0) -> Iterator[Any]:
    worker = app.WorkController(
        hostname="embedded@batchwork",
        pool_cls="solo",
        concurrency=1,
        without_heartbeat=True,
        without_mingle=True,
        without_gossip=True,
        loglevel="WARNING",
    )
    from worker.broker.in_process import IN_PROCESS_WORKER

    thread = threading.Thread(target=worker.start, name="batchwork-embedded-worker", daemon=True)
    thread.start()
    try:
        _wait_for_engine(worker, thread, timeout_s)
        IN_PROCESS_WORKER.set()
        yield worker
    finally:
        IN_PROCESS_WORKER.clear()
        worker.stop(in_sighandler=False)
        thread.join(timeout_s)


def _wait_for_engine(worker: Any, thread: threading.Thread, timeout_s: float) -> None:
    for _ in range(int(timeout_s / 0.05)):
        engine = getattr(worker.consumer, "batchwork_engine", None) if worker.consumer else None
        if engine is not None and engine.ready.is_set():
            return
        if not thread.is_alive():
            cause = getattr(worker.consumer, "batchwork_start_error", None) if worker.consumer else None
            raise SetupError(f"the embedded worker could not start: {cause or 'see the log above'}")
        threading.Event().wait(0.05)
    raise SetupError(f"the embedded worker did not start within {timeout_s:.0f} s")
