"""The enqueue surface: ``infer.delay(model="minilm", inputs=[...], priority="normal")``.

A call is checked whole before anything is enqueued, and its message goes out with the job's record in one
Redis round trip (the jobs port's ``delay``, worker/jobs.py). The task id is the job id;
``AsyncResult.state``, ``.ready()`` and ``.get()`` read the batchwork store. Importing this module loads
Celery and the checks, never the engine, the store's writer or a model.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any
from uuid import uuid4

from celery import Task

from worker.calls import TASK_NAME, check_items, new_job
from worker.celery_app import app
from worker.errors import InvalidInput

# Celery options batchwork does not honour, and why; they are refused rather than silently dropped.
_REFUSED_OPTIONS = {
    "countdown": "items start as soon as a batch forms; deadline_s= bounds how late they may start",
    "eta": "items start as soon as a batch forms; deadline_s= bounds how late they may start",
    "priority": "pass priority='high', 'normal' or 'bulk' as an argument of the call",
    "queue": "the queue follows the call's priority argument",
    "routing_key": "the queue follows the call's priority argument",
    "exchange": "the queue follows the call's priority argument",
    "link": "a job has many items: poll AsyncResult.get(), client.wait or client.status instead",
    "link_error": "a job has many items: poll AsyncResult.get(), client.wait or client.status instead",
    "task_id": "batchwork chooses the job id (the returned task id); a caller cannot name one",
}


class InferTask(Task):
    def apply_async(
        self, args: Any = None, kwargs: Any = None, task_id: str | None = None, **options: Any
    ) -> Any:
        from worker.jobs import default_jobs

        if args:
            raise InvalidInput("infer takes keyword arguments only: infer.delay(model=..., inputs=[...])")
        if task_id is not None:
            options["task_id"] = task_id
        kwargs = _with_expiry(dict(kwargs or {}), options.pop("expires", None))
        _refuse(options)
        jobs = default_jobs()
        call = new_job(str(uuid4()), kwargs, jobs.settings)
        check_items(call, jobs.settings)
        return self.AsyncResult(jobs.delay(call))


def _with_expiry(kwargs: dict[str, Any], expires: Any) -> dict[str, Any]:
    """Celery's ``expires`` (seconds or a datetime) means what batchwork's ``deadline_s`` does."""
    if expires is None:
        return kwargs
    if "deadline_s" in kwargs:
        raise InvalidInput("give deadline_s or Celery's expires, not both")
    if isinstance(expires, datetime):
        when = expires if expires.tzinfo else expires.replace(tzinfo=UTC)
        expires = (when - datetime.now(UTC)).total_seconds()
    return {**kwargs, "deadline_s": expires}


def _refuse(options: dict[str, Any]) -> None:
    # Celery's own calls pass some options as None; only options given a value are refused.
    given = sorted(name for name, value in options.items() if value is not None)
    if given:
        reasons = "; ".join(
            f"{name}: {_REFUSED_OPTIONS.get(name, 'not supported by batchwork')}" for name in given
        )
        raise InvalidInput(f"infer does not take Celery option(s) {', '.join(given)} ({reasons})")


@app.task(base=InferTask, name=TASK_NAME, bind=True)
def infer(self: Task, model: str, inputs: list[Any], priority: str = "normal", **_: Any) -> None:
    raise RuntimeError(
        f"{TASK_NAME} runs only in a batching worker (`batchwork worker`), not as a plain task"
    )
