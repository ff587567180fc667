"""The worker's consumer, as a bootstep and a task strategy meet it.

Private things (contract: tests/unit/test_celery_compat.py):
- the consumer's bootsteps by their module paths (``celery.worker.consumer.events:Events``,
  ``...tasks:Tasks``): a step that needs the task consumer's channel and the event dispatcher starts after
  them, and ``requires`` names them by path.
- a task class's ``Strategy``: Celery instantiates it as ``Strategy(task, app, consumer, **options)`` and
  calls what it returns once per message as ``handler(message, body, ack, reject, callbacks)``.
- the consumer's ``task_consumer.channel``, ``hub`` and ``event_dispatcher`` attributes, which a step reads
  when it starts (a reconnect brings new ones).
"""

from __future__ import annotations

from typing import Any

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
