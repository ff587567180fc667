"""Publishing a task through Celery's own ``Task.apply_async``, past a task class that overrides it.

Private thing (contract: tests/unit/test_celery_compat.py): ``celery.Task.apply_async`` called unbound on a
task whose class replaces it. ``InferTask.apply_async`` is batchwork's enqueue (it checks a whole call and
writes through the Redis producer); the in-process path of ``batchwork run`` needs Celery's plain publish
to its in-memory broker instead, with ``argsrepr``/``kwargsrepr`` passed on to the message's headers.
"""

from __future__ import annotations

from typing import Any

from celery import Task


def publish_plainly(task: Task, kwargs: dict[str, Any], **options: Any) -> Any:
    """Celery's own ``apply_async`` of ``task`` (with ``options`` such as ``queue``, ``producer``,
    ``task_id``, ``kwargsrepr``), whatever ``task``'s class does in its own."""
    return Task.apply_async(task, kwargs=kwargs, **options)
