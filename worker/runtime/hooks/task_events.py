"""Flower's task events for a worker that runs a message's items in batches: task-received when a message is
parsed, task-started when its first item runs, task-succeeded once every item's outcome is stored (its
result counts the items and the failed ones), task-failed for a message refused whole.

Events only queue in the outbox; the consumer's thread sends them (outbox.py), so no hook point waits here.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol

from worker.runtime.deliveries import Delivery, Pack
from worker.runtime.hooks import Admission, Hook, Run


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
