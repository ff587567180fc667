"""A read-only Celery result backend: ``AsyncResult.state``, ``.ready()`` and ``.get()`` answered from
elsewhere.

Private thing (contract: tests/unit/test_celery_compat.py): ``BaseBackend._get_task_meta_for(task_id)``,
which every read of an ``AsyncResult`` goes through, and the meta dict it returns (``task_id``, ``status``,
``result``, ``traceback``, ``children``, ``date_done``). Celery documents no other way to answer reads
without storing results through it.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from celery.backends.base import BaseBackend


class ReadOnlyBackend(BaseBackend):
    """A result backend whose reads are ``task_meta``'s answers; nothing is stored through it."""

    def _get_task_meta_for(self, task_id: str) -> dict[str, Any]:
        return self.task_meta(task_id)

    def task_meta(self, task_id: str) -> dict[str, Any]:
        """The task's state as ``meta`` makes it."""
        raise NotImplementedError


def meta(task_id: str, status: str, result: Any = None, done: datetime | None = None) -> dict[str, Any]:
    """What Celery reads for a task: its state, its result (or exception) and when it finished."""
    return {
        "task_id": task_id,
        "status": status,
        "result": result,
        "traceback": None,
        "children": [],
        "date_done": done,
    }
