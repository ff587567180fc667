"""The producers' path to the in-process worker of ``batchwork run`` (no broker configured): publish to the
in-memory broker, which only a worker in this very process can read, and only while one runs.

A producer concern, kept out of the Celery app's module: the app names no producer, the producer names the
app. It never runs a model or touches SQL.
"""

from __future__ import annotations

import threading
from typing import Any

from worker.broker.keys import Keys
from worker.calls import TASK_NAME, InferMessage, NewJob
from worker.celery_app import app
from worker.celery_compat import publish_plainly
from worker.settings import Settings

# Set while an in-process worker runs (``batchwork run`` with no broker): only then may a producer publish
# to the in-memory broker, which no other process can read.
IN_PROCESS_WORKER = threading.Event()


def publish_in_process(call: NewJob, settings: Settings) -> None:
    """Publish to the in-memory broker, for the in-process worker of ``batchwork run``."""
    # The task by name from the app's registry (the worker running in this process imported it).
    infer = app.tasks[TASK_NAME]
    size = settings.submit_chunk_size
    with app.producer_or_acquire() as producer:
        for start in range(0, len(call.inputs), size):
            # ``call`` may be a window of its job (``batchwork run`` publishes a file a window at a time).
            message = call.message(start, size)
            task_id = call.job_id if message.offset == 0 else None
            _send(infer, message, task_id, Keys.of(settings).queue(call.priority), producer)


def _send(task: Any, message: InferMessage, task_id: str | None, queue: str, producer: Any) -> None:
    # Celery's own apply_async, not infer's (which checks and enqueues a whole call). A summary as the
    # message's kwargsrepr, as the Redis producer writes it: Celery's repr of every item costs more than
    # the send.
    summary = f"{{'model': {message.model!r}, 'job_id': {message.job_id!r}}}"
    publish_plainly(
        task,
        message.kwargs(),
        task_id=task_id,
        queue=queue,
        producer=producer,
        argsrepr="()",
        kwargsrepr=summary,
    )
