"""kombu's in-memory transport of the embedded run (``batchwork run`` with no broker), made to stop promptly.

Private thing (contract: tests/unit/test_celery_compat.py): Celery drives a transport without an event loop
(``celery.worker.loops.synloop``) with ``connection.drain_events(timeout=2.0)`` and looks for a stop request
only between two calls, so an in-process worker took two seconds to stop after its last message. Each wait
here lasts at most STOP_CHECK_S.
"""

from __future__ import annotations

from typing import Any

from kombu.transport import memory

# How long one wait for a message lasts at most: how soon a stop is noticed.
STOP_CHECK_S = 0.05


class Transport(memory.Transport):
    def drain_events(self, connection: Any, timeout: Any = None, **kwargs: Any) -> Any:
        wait_s = STOP_CHECK_S if timeout is None else min(timeout, STOP_CHECK_S)
        return super().drain_events(connection, timeout=wait_s, **kwargs)
