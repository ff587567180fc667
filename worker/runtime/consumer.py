"""Where Celery meets the engine: a task strategy, a consumer bootstep, task events, the broker epoch.

Celery's default strategy would run each message as one task. Ours hands the raw message to the
engine and leaves it unacknowledged until every item in it is stored. Nothing here runs models.
"""

from __future__ import annotations

import logging
import socket
import time
import uuid
from typing import Any

from celery import bootsteps
from celery.utils.saferepr import saferepr

from worker.calls import TASK_NAME
from worker.runtime import metrics
from worker.runtime.deliveries import Delivery, Message
from worker.runtime.engine import Engine
from worker.runtime.loop import IntakeThrottle, LeaseRenewal, LoopAcks, broker_redis
from worker.settings import get_settings
from worker.store.results import ResultStore

log = logging.getLogger(__name__)


def batching_strategy(task: Any, app: Any, consumer: Any, **_options: Any) -> Any:
    """Celery calls this once per task type; the handler it returns runs for every message."""

    def on_message(message: Message, body: Any, ack: Any, reject: Any, callbacks: Any, **_: Any) -> None:
        metrics.delivered(message)
        consumer.batchwork_engine.accept(message)

    return on_message


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
        result = {"items": len(delivery.call.inputs) if delivery.call else 0, "failed": delivery.failed}
        self._send("task-succeeded", delivery, result=saferepr(result), runtime=runtime)


class BrokerEpoch:
    """Notices when Redis came back empty after a restart, by a key every worker expects to find.

    The first worker sets the key; a worker whose broker connection restarts and finds the key
    gone (or replaced) knows the queues went with it and tells the engine.
    """

    KEY = "batchwork:broker-epoch"

    def __init__(self) -> None:
        self.epoch: bytes | str | None = None

    def check(self, engine: Engine) -> None:
        client = broker_redis(get_settings().broker_url)
        if client is None:
            return  # not Redis (the in-memory broker of the embedded run)
        try:
            client.set(self.KEY, uuid.uuid4().hex, nx=True)
            epoch = client.get(self.KEY)
        except Exception as exc:
            log.warning("could not read the broker epoch: %s", exc)
            return
        if self.epoch is not None and epoch != self.epoch:
            engine.broker_lost_messages()
        self.epoch = epoch


class BatchingStep(bootsteps.StartStopStep):
    """Runs one engine per worker process, across consumer restarts (a broker reconnect)."""

    requires = ("celery.worker.consumer.events:Events",)

    def __init__(self, consumer: Any, **kwargs: Any) -> None:
        consumer.batchwork_engine = None
        self.acks = LoopAcks()
        self.epoch = BrokerEpoch()

    def start(self, consumer: Any) -> None:
        self.acks.attach(consumer.hub)
        if consumer.batchwork_engine is not None:
            self.epoch.check(consumer.batchwork_engine)  # a restart: did the broker lose data?
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
        metrics.serve(settings, engine.holdings, engine.models)
        consumer.batchwork_engine = engine
        self.epoch.check(engine)
        if consumer.hub is not None:
            self.acks.on_tick.append(IntakeThrottle(consumer, engine.holdings, settings.max_held_items))
            self.acks.on_tick.append(
                LeaseRenewal(consumer, engine.holdings, settings.visibility_timeout_s / 4)
            )
        log.info("batchwork engine ready on %s", engine.device)

    def shutdown(self, consumer: Any) -> None:
        engine = consumer.batchwork_engine
        if engine is not None:
            engine.stop(finish_waiting=False)
            self.acks.flush()
            consumer.batchwork_engine = None
