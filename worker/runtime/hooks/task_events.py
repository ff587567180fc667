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

from worker.calls import TASK_NAME
from worker.celery_compat import publish_task_events, register_encoder, task_events_wanted
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

    def event(self, event: dict[str, Any]) -> None: ...


class TaskEvents(Hook):
    """Each event is the dict Celery's ``Event`` makes, less what the sender adds (``publish_events``); it is
    made where it happens, so its timestamp is when."""

    def __init__(self, outbox: EventSink) -> None:
        self.outbox = outbox

    def received(self, delivery: Delivery, admission: Admission) -> None:
        call = delivery.call
        assert call is not None
        summary = {"model": call.model, "job_id": call.job_id, "items": len(call.inputs)}
        self.outbox.event(
            {
                "type": "task-received",
                "uuid": delivery.task_id,
                "timestamp": time.time(),
                "name": TASK_NAME,
                "args": "()",
                "kwargs": repr(summary),
                "retries": 0,
            }
        )

    def before_batch(self, runs: Sequence[Run]) -> dict[Pack, str]:
        now = time.time()
        for pack, _ in runs:
            delivery = pack.delivery
            if not delivery.started:
                delivery.started = True
                self.outbox.event({"type": "task-started", "uuid": delivery.task_id, "timestamp": now})
        return {}

    def settled(self, deliveries: Sequence[Delivery], error: str | None = None) -> None:
        now = time.time()
        if error is not None:
            for delivery in deliveries:
                self.outbox.event(
                    {
                        "type": "task-failed",
                        "uuid": delivery.task_id,
                        "timestamp": now,
                        "exception": error,
                        "traceback": "",
                    }
                )
            return
        ended = time.monotonic()
        for delivery in deliveries:
            items = len(delivery.call.inputs) if delivery.call else 0
            self.outbox.event(
                {
                    "type": "task-succeeded",
                    "uuid": delivery.task_id,
                    "timestamp": now,
                    "result": repr({"items": items, "failed": delivery.failed}),
                    "runtime": max(0.0, ended - delivery.received_at),
                }
            )


def publish_events(dispatcher: Any, events: list[dict[str, Any]]) -> None:
    """Send queued events through Celery's event dispatcher (on the consumer's thread, which owns it), as
    lists of at most EVENTS_PER_MESSAGE: what ``send`` would add to each (the sender, its Lamport clock) is
    added here, at a fraction of ``send``'s cost."""
    if dispatcher is None or not task_events_wanted(dispatcher):
        return
    sender = {
        "hostname": dispatcher.hostname,
        # The UTC offset in hours, as Celery reckons it (once a tick, not once an event).
        "utcoffset": (time.altzone if time.localtime().tm_isdst else time.timezone) // 3600,
        "pid": dispatcher.pid,
    }
    forward = dispatcher.clock.forward
    for event in events:
        event.update(sender)
        event["clock"] = forward()
    for start in range(0, len(events), EVENTS_PER_MESSAGE):
        try:
            publish_task_events(dispatcher, events[start : start + EVENTS_PER_MESSAGE], EVENT_SERIALIZER)
        except Exception as exc:  # events are for monitoring; never stall the work for them
            log.debug("could not send %d task events: %s", len(events), exc)
