"""The enqueue surface: ``infer.delay(model="minilm", inputs=[...], priority="normal")``.

A call is checked and its job registered in SQL before the message is published, so a bad call
enqueues nothing and ``status(job_id)`` works at once. The task id is the job id.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any
from uuid import uuid4

from celery import Task

from worker.calls import TASK_NAME, InferCall, check_items, expiry, parse_call
from worker.celery_app import app, queue_for
from worker.models.base import InvalidInput
from worker.settings import get_settings
from worker.store.results import JobSpec, ResultStore
from worker.store.schema import migrate


@lru_cache(maxsize=4)
def job_store(url: str) -> ResultStore:
    """The store of producers and pollers; a SQLite database is created on first use."""
    if url.startswith("sqlite"):
        migrate(url)
    return ResultStore.from_url(url)


def publish(call: InferCall, task_id: str, producer: Any = None) -> None:
    """Send one message, unchecked; callers have checked ``call`` and registered its job."""
    Task.apply_async(
        infer,
        kwargs=call.kwargs(),
        task_id=task_id,
        queue=queue_for(call.priority, get_settings()),
        producer=producer,
    )


class InferTask(Task):
    # The batching worker takes these messages through its own strategy, never as one task each.
    Strategy = "worker.runtime.consumer:batching_strategy"

    def apply_async(
        self, args: Any = None, kwargs: Any = None, task_id: str | None = None, **options: Any
    ) -> Any:
        if args:
            raise InvalidInput("infer takes keyword arguments only: infer.delay(model=..., inputs=[...])")
        settings = get_settings()
        task_id = task_id or str(uuid4())
        kwargs = dict(kwargs or {})
        if "deadline_s" in kwargs:
            kwargs["expires_at"] = expiry(kwargs.pop("deadline_s"))
        call = parse_call(task_id, kwargs, settings)
        check_items(call, settings)
        job_store(settings.database_url).create_job(
            JobSpec(call.job_id, call.model, call.priority, call.total)
        )
        publish(call, task_id, options.get("producer"))
        return self.AsyncResult(task_id)


@app.task(base=InferTask, name=TASK_NAME, bind=True)
def infer(self: Task, model: str, inputs: list[Any], priority: str = "normal", **_: Any) -> None:
    raise RuntimeError(
        f"{TASK_NAME} runs only in a batching worker (`batchwork worker`), not as a plain task"
    )
