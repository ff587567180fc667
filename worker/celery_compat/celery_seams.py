"""Celery's private parts batchwork relies on, one section per seam; a Celery upgrade reads this file against
the new version (contract tests: tests/unit/celery_compat/test_celery_compat.py, pinned to
pyproject.toml's celery).

- The task message: protocol 2's headers and body, written by hand by producers in kombu's Redis envelope.
- Publishing plainly: ``Task.apply_async`` called unbound, past a task class that overrides it.
- The consumer: its bootsteps named by module path, ``Task.Strategy``'s call shape, and the consumer's
  ``task_consumer``, ``hub`` and ``event_dispatcher`` attributes.
- Task events: ``EventDispatcher.buffer_limit`` and ``.serializer``, changed after Celery made it.
- Results: ``BaseBackend._get_task_meta_for`` and the meta dict it returns.
"""

from __future__ import annotations

import base64
import uuid
from datetime import datetime
from typing import Any

import orjson
from celery import Task
from celery.backends.base import BaseBackend

# -- the task message -----------------------------------------------------------------------------------
# What Celery's ``amqp.as_task_v2`` writes and a worker reads: the headers, the body ``[args, kwargs,
# embed]``, and the JSON kombu's Redis channel pushes to a queue list (body base64-encoded, the delivery info
# in the properties). Celery's own publish path costs a producer about as much as the whole Redis round trip,
# so producers write the same bytes directly; any Celery worker can read them.

# The body's third part (protocol 2's "embed"): no callbacks, errbacks, chain or chord.
_EMBED = b'{"callbacks":null,"errbacks":null,"chain":null,"chord":null}'


def task_message(
    task_name: str, task_id: str, queue: str, kwargs: bytes, *, kwargsrepr: str, origin: str
) -> bytes:
    """The message kombu's Redis channel would push to ``queue`` for Celery's ``apply_async`` of
    ``task_name`` with no args and ``kwargs`` (their JSON object, as bytes), ignoring its result."""
    body = b"[[]," + kwargs + b"," + _EMBED + b"]"
    headers: dict[str, Any] = {
        "lang": "py",
        "task": task_name,
        "id": task_id,
        "shadow": None,
        "eta": None,
        "expires": None,
        "group": None,
        "group_index": None,
        "retries": 0,
        "timelimit": [None, None],
        "root_id": task_id,
        "parent_id": None,
        "argsrepr": "()",
        "kwargsrepr": kwargsrepr,
        "origin": origin,
        "ignore_result": True,
        "replaced_task_nesting": 0,
        "stamped_headers": None,
        "stamps": {},
    }
    properties = {
        "correlation_id": task_id,
        "reply_to": None,
        "delivery_mode": 2,
        "delivery_info": {"exchange": "", "routing_key": queue},
        "priority": 0,
        "body_encoding": "base64",
        "delivery_tag": str(uuid.uuid4()),
    }
    return orjson.dumps(
        {
            "body": base64.b64encode(body).decode(),
            "content-encoding": "utf-8",
            "content-type": "application/json",
            "headers": headers,
            "properties": properties,
        }
    )


# -- publishing plainly ---------------------------------------------------------------------------------
# ``InferTask.apply_async`` is batchwork's enqueue (it checks a whole call and writes through the Redis
# producer); the in-process path of ``batchwork run`` needs Celery's plain publish to its in-memory broker
# instead, with ``argsrepr``/``kwargsrepr`` passed on to the message's headers.


def publish_plainly(task: Task, kwargs: dict[str, Any], **options: Any) -> Any:
    """Celery's own ``apply_async`` of ``task`` (with ``options`` such as ``queue``, ``producer``,
    ``task_id``, ``kwargsrepr``), whatever ``task``'s class does in its own."""
    return Task.apply_async(task, kwargs=kwargs, **options)


# -- the consumer ---------------------------------------------------------------------------------------
# A step that needs the task consumer's channel and the event dispatcher starts after the consumer's own
# steps that make them, and ``requires`` names those by module path. A task class's ``Strategy`` is
# instantiated as ``Strategy(task, app, consumer, **options)`` and what it returns is called once per message
# as ``handler(message, body, ack, reject, callbacks)``. The consumer's ``task_consumer.channel``, ``hub`` and
# ``event_dispatcher`` are read when a step starts (a reconnect brings new ones).

# A consumer step that runs after these has the task consumer (its channel) and the event dispatcher.
AFTER_TASKS_AND_EVENTS = ("celery.worker.consumer.events:Events", "celery.worker.consumer.tasks:Tasks")


def task_channel(consumer: Any) -> Any:
    """The channel the consumer's tasks come through now (a reconnect replaces it)."""
    return consumer.task_consumer.channel


def event_loop(consumer: Any) -> Any:
    """The consumer's event loop (a kombu Hub), or None without one (a transport that only polls)."""
    return consumer.hub


def event_dispatcher(consumer: Any) -> Any:
    """The consumer's task event dispatcher, or None before its step started."""
    return getattr(consumer, "event_dispatcher", None)


# -- task events ----------------------------------------------------------------------------------------
# ``EventDispatcher.buffer_limit`` and ``.serializer`` are set once at construction by Celery's consumer; the
# dispatcher reads them at every send, so the worker's dispatcher is changed in place.


def send_in_bulk(dispatcher: Any, buffer_limit: int, serializer: str) -> None:
    """Make Celery's ``dispatcher`` buffer up to ``buffer_limit`` task events per message (a "task.multi",
    as Flower reads it) and write them with ``serializer``."""
    dispatcher.buffer_limit = max(dispatcher.buffer_limit, buffer_limit)
    dispatcher.serializer = serializer


# -- results --------------------------------------------------------------------------------------------
# Every read of an ``AsyncResult`` goes through ``BaseBackend._get_task_meta_for(task_id)`` and the meta dict
# it returns; Celery documents no other way to answer reads without storing results through it.


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
