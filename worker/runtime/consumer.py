"""Where Celery meets the engine: a task strategy, a consumer bootstep, acks and task events.

Celery's default strategy would run each message as one task. Ours hands the raw message to the
engine and leaves it unacknowledged until every item in it is stored. Nothing here runs models.
"""

from __future__ import annotations

import logging
import socket
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from celery import bootsteps
from celery.utils.saferepr import saferepr
from kombu import Queue

from worker.calls import TASK_NAME
from worker.runtime.engine import Delivery, Engine, Message
from worker.settings import PRIORITIES, Settings, get_settings
from worker.store.results import ResultStore

log = logging.getLogger(__name__)


def queue_name(priority: str, settings: Settings) -> str:
    return f"{settings.queue}.{priority}"


ACK_INTERVAL_S = 0.005


def batching_strategy(task: Any, app: Any, consumer: Any, **_options: Any) -> Any:
    """Celery calls this once per task type; the handler it returns runs for every message."""

    def on_message(message: Message, body: Any, ack: Any, reject: Any, callbacks: Any, **_: Any) -> None:
        consumer.batchwork_engine.accept(message)

    return on_message


class LoopAcks:
    """Acknowledges messages on the consumer's own thread, where kombu expects it.

    With an event loop (Redis) the store thread queues messages and a 5 ms timer acks them; the
    timer also keeps the loop from sleeping a full second before it fetches more. Without one
    (the in-memory broker of the embedded run) acking in place is safe and immediate.
    """

    def __init__(self) -> None:
        self._pending: deque[Message] = deque()
        self._hub: Any = None
        self.on_tick: list[Callable[[], None]] = []

    def attach(self, hub: Any) -> None:
        if hub is not None and hub is not self._hub:
            self._hub = hub
            hub.call_repeatedly(ACK_INTERVAL_S, self.tick)

    def ack(self, messages: Sequence[Message]) -> None:
        if self._hub is None:
            for message in messages:
                message.ack_log_error(log, (Exception,))  # type: ignore[attr-defined]
        else:
            self._pending.extend(messages)

    def tick(self) -> None:
        self.flush()
        for callback in self.on_tick:
            callback()

    def flush(self) -> None:
        while self._pending:
            self._pending.popleft().ack_log_error(log, (Exception,))  # type: ignore[attr-defined]


class IntakeThrottle:
    """Stops fetching a lane's queue while the worker already holds enough of its items.

    Priority must hold in the broker too: without this, a bulk backlog would fill the prefetch window
    and an urgent message could not even be fetched until bulk messages were acked. The high queue
    is never paused; normal and bulk pause at ``max_held_items`` and resume below half of it. Kept
    on the consumer's thread (the loop timer); queues are re-subscribed in priority order because
    Redis BRPOP serves the queues in the order they were subscribed.
    """

    def __init__(self, consumer: Any, engine: Engine, max_held_items: int) -> None:
        self._consumer = consumer
        self._engine = engine
        self._limit = max_held_items
        self._paused: set[str] = set()

    def __call__(self) -> None:
        paused = set(self._paused)
        for priority in PRIORITIES[1:]:
            held = self._engine.held_items(priority)
            if held >= self._limit:
                paused.add(priority)
            elif held < self._limit // 2:
                paused.discard(priority)
        if paused != self._paused:
            self._resubscribe(paused)

    def _resubscribe(self, paused: set[str]) -> None:
        tasks = self._consumer.task_consumer
        settings = get_settings()
        for priority in PRIORITIES[1:]:
            tasks.cancel_by_queue(queue_name(priority, settings))
        for priority in PRIORITIES[1:]:
            if priority not in paused:
                tasks.add_queue(Queue(queue_name(priority, settings)))
        tasks.consume()
        log.info("intake paused for: %s", ", ".join(sorted(paused)) or "none")
        self._paused = paused


class CeleryTaskEvents:
    """task-received / started / succeeded events per message, as Celery's own worker sends them."""

    def __init__(self, consumer: Any) -> None:
        self._consumer = consumer

    def _send(self, kind: str, delivery: Delivery, **fields: Any) -> None:
        dispatcher = getattr(self._consumer, "event_dispatcher", None)
        if dispatcher is None or not dispatcher.enabled:
            return  # send() itself skips task events unless the worker was asked for them
        try:
            dispatcher.send(kind, uuid=delivery.task_id, **fields)
        except Exception as exc:  # events are for monitoring; never stall the work for them
            log.debug("could not send %s: %s", kind, exc)

    def received(self, delivery: Delivery) -> None:
        call = delivery.call
        summary = (
            {} if call is None else {"model": call.model, "job_id": call.job_id, "items": len(call.inputs)}
        )
        self._send(
            "task-received", delivery, name=TASK_NAME, args="()", kwargs=saferepr(summary, 1024), retries=0
        )

    def started(self, delivery: Delivery) -> None:
        self._send("task-started", delivery)

    def finished(self, delivery: Delivery) -> None:
        runtime = max(0.0, time.monotonic() - delivery.received_at)
        if delivery.error is not None:
            self._send("task-failed", delivery, exception=delivery.error, traceback="")
            return
        result = {"items": delivery.call.total if delivery.call else 0, "failed": delivery.failed}
        self._send("task-succeeded", delivery, result=saferepr(result), runtime=runtime)


class BatchingStep(bootsteps.StartStopStep):
    """Runs one engine per worker process, across consumer restarts (a broker reconnect)."""

    requires = ("celery.worker.consumer.events:Events",)

    def __init__(self, consumer: Any, **kwargs: Any) -> None:
        consumer.batchwork_engine = None
        self.acks = LoopAcks()

    def start(self, consumer: Any) -> None:
        self.acks.attach(consumer.hub)
        if consumer.batchwork_engine is not None:
            return
        from worker.models.device import resolve_device

        settings = get_settings()
        engine = Engine(
            settings,
            ResultStore.from_url(settings.database_url),
            self.acks,
            CeleryTaskEvents(consumer),
            device=resolve_device(settings.device),
            worker_name=consumer.hostname or socket.gethostname(),
        )
        engine.start(preload=settings.preload)
        consumer.batchwork_engine = engine
        if consumer.hub is not None:
            self.acks.on_tick.append(IntakeThrottle(consumer, engine, settings.max_held_items))
        log.info("batchwork engine ready on %s", engine.device)

    def shutdown(self, consumer: Any) -> None:
        engine = consumer.batchwork_engine
        if engine is not None:
            engine.stop(finish_waiting=False)
            self.acks.flush()
            consumer.batchwork_engine = None
