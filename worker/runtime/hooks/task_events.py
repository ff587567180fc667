"""Flower's task events for a worker that runs a message's items in batches: task-received when a message is
parsed, task-started when its first item runs, task-succeeded once every item's outcome is stored (its
result counts the items and the failed ones), task-failed for a message refused whole.

Events only queue in the outbox; the consumer's thread sends them (``publish_events``, called by the outbox's
tick), so no hook point waits here. How they are written (one JSON list per tick, orjson) is here too.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any, Protocol

import orjson

from worker.celery_compat import register_encoder, send_in_bulk
from worker.runtime.deliveries import Delivery, Pack
from worker.runtime.hooks import Admission, Hook, Run

log = logging.getLogger(__name__)

# Task events published in one message at most (Flower reads such a list as it reads single events).
EVENTS_PER_MESSAGE = 2048
EVENT_SERIALIZER = "batchwork-events"


def _register_event_serializer() -> None:
    """Task events are plain JSON, three per message; kombu's json writer was a tenth of a busy worker's
    time. orjson writes the same JSON, and a receiver (Flower) reads it as any application/json message.
    Encoder only: reading application/json stays kombu's, and so does the name replies are sent under."""
    register_encoder(EVENT_SERIALIZER, _event_json, "application/json", "utf-8")


def _event_json(value: Any) -> str:
    return orjson.dumps(value, default=str).decode()


_register_event_serializer()


class EventSink(Protocol):
    """Where events queue (the Outbox)."""

    def event(self, kind: str, delivery: Delivery, **fields: Any) -> None: ...


class TaskEvents(Hook):
    def __init__(self, outbox: EventSink) -> None:
        self.outbox = outbox

    def received(self, delivery: Delivery, admission: Admission) -> None:
        call = delivery.call
        assert call is not None
        summary = {"model": call.model, "job_id": call.job_id, "items": len(call.inputs)}
        self.outbox.event(
            "task-received", delivery, name="batchwork.infer", args="()", kwargs=repr(summary), retries=0
        )

    def before_batch(self, runs: Sequence[Run]) -> dict[Pack, str]:
        for pack, _ in runs:
            delivery = pack.delivery
            if not delivery.started:
                delivery.started = True
                self.outbox.event("task-started", delivery)
        return {}

    def settled(self, deliveries: Sequence[Delivery], error: str | None = None) -> None:
        if error is not None:
            for delivery in deliveries:
                self.outbox.event("task-failed", delivery, exception=error, traceback="")
            return
        for delivery in deliveries:
            runtime = max(0.0, time.monotonic() - delivery.received_at)
            items = len(delivery.call.inputs) if delivery.call else 0
            self.outbox.event(
                "task-succeeded",
                delivery,
                result=repr({"items": items, "failed": delivery.failed}),
                runtime=runtime,
            )


def publish_events(dispatcher: Any, events: Sequence[tuple[str, Delivery, dict[str, Any]]]) -> None:
    """Send queued events through Celery's event dispatcher (on the consumer's thread, which owns it)."""
    if dispatcher is None or not dispatcher.enabled:
        return  # send() itself skips task events unless the worker was asked for them
    # Celery's dispatcher buffers task events while an event loop runs and publishes them as one
    # "task.multi" message per turn of the loop, or per 24 events; a tick's worth is one message.
    send_in_bulk(dispatcher, EVENTS_PER_MESSAGE, EVENT_SERIALIZER)
    # send() reads the UTC offset per event (a localtime() call, a tenth of its cost); one a tick will do.
    offset = (time.altzone if time.localtime().tm_isdst else time.timezone) // 3600  # as Celery reckons it

    def tick_offset() -> int:
        return offset

    for kind, delivery, fields in events:
        try:
            dispatcher.send(kind, uuid=delivery.task_id, utcoffset=tick_offset, **fields)
        except Exception as exc:  # events are for monitoring; never stall the work for them
            log.debug("could not send %s: %s", kind, exc)
