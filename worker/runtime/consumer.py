"""Where Celery meets the engine: the consumer bootstep and the broker epoch.

Celery would run each message as one task. The bootstep has the consumer hand each raw infer message to the
engine, which leaves it unacknowledged until every item in it is stored. Nothing here runs models.
"""

from __future__ import annotations

import logging
import socket
import uuid
from functools import partial
from typing import Any

from celery import bootsteps
from celery.exceptions import WorkerShutdown

from worker import celery_compat
from worker.batching.policy import PRIORITIES
from worker.broker.census import MessageCensus
from worker.broker.keys import Keys
from worker.calls import TASK_NAME
from worker.runtime.engine import Engine
from worker.runtime.hooks import metrics
from worker.runtime.hooks.journal import Journal
from worker.runtime.outbox import FetchThrottle, LeaseRenewal, Outbox
from worker.settings import Settings, get_settings

log = logging.getLogger(__name__)


class BrokerEpoch:
    """Notices when Redis came back empty after a restart, by a key every worker expects to find.

    The first worker sets the key; a worker whose broker connection restarts and finds the key gone (or
    replaced) knows the queues went with it and tells the engine.
    """

    def __init__(self, client: Any, key: str) -> None:
        self.client = client
        self.key = key
        self.epoch: bytes | None = None

    def check(self, engine: Engine) -> None:
        try:
            self.client.set(self.key, uuid.uuid4().hex, nx=True)
            epoch = self.client.get(self.key)
        except Exception as exc:
            log.warning("could not read the broker epoch: %s", exc)
            return
        if self.epoch is not None and epoch != self.epoch:
            engine.broker_lost_messages()
        self.epoch = epoch


class BatchingStep(bootsteps.StartStopStep):
    """Runs one engine per worker process, across consumer restarts (a broker reconnect)."""

    # After the task consumer exists (its channel fetches and acks) and the event dispatcher too. Messages
    # reach the engine only once the event loop runs, after every step has started.
    requires = celery_compat.AFTER_TASKS_AND_EVENTS

    def __init__(self, consumer: Any, **kwargs: Any) -> None:
        consumer.batchwork_engine = None
        consumer.batchwork_start_error = None
        self.settings = get_settings()
        self.outbox = Outbox()
        self.redis = _broker_redis(self.settings)
        self.epoch = None if self.redis is None else BrokerEpoch(self.redis, Keys.of(self.settings).epoch)

    def start(self, consumer: Any) -> None:
        channel = celery_compat.task_channel(consumer)
        # The dispatcher is looked up at each send: a restart makes a new one.
        dispatcher = partial(celery_compat.event_dispatcher, consumer)
        self.outbox.attach(celery_compat.event_loop(consumer), channel, dispatcher)
        engine = consumer.batchwork_engine
        if engine is None:
            engine = consumer.batchwork_engine = self._start_or_shut_down(consumer)
            self.outbox.on_tick.append(self._lease_renewal(consumer, engine))
        if self.epoch is not None:
            self.epoch.check(engine)  # at a restart: did the broker lose its data?
        self._gate(channel, engine)
        celery_compat.deliver_directly(consumer, TASK_NAME, engine.accept)

    def shutdown(self, consumer: Any) -> None:
        engine = consumer.batchwork_engine
        if engine is not None:
            engine.stop()
            self.outbox.flush()
            consumer.batchwork_engine = None

    def _start_or_shut_down(self, consumer: Any) -> Engine:
        """The engine, or the worker's end with exit code 1 and one line naming the cause (Celery would log
        a traceback and, under `batchwork worker`, exit 0). The cause stays on the consumer for the embedded
        run."""
        try:
            return self._start_engine(consumer)
        except Exception as exc:
            cause = startup_failure(exc)
            if cause is None:
                raise  # a bug: Celery logs its traceback and the worker still exits 1
            consumer.batchwork_start_error = cause
            if not self.settings.embedded:  # the embedded run says it itself, as its one line
                log.critical("the worker cannot start: %s", cause)
            raise WorkerShutdown(1) from None

    def _start_engine(self, consumer: Any) -> Engine:
        from worker.models.device import resolve_device
        from worker.store.results import ResultStore
        from worker.store.tuned import TunedLimits

        settings = self.settings
        store = ResultStore.from_url(settings.database_url)
        engine = Engine(
            settings,
            store,
            self.outbox,
            tuned_limits=TunedLimits(store.engine),
            device=resolve_device(settings.device),
            worker_name=consumer.hostname or socket.gethostname(),
            journal=None if self.redis is None else Journal(self.redis, Keys.of(settings)),
            census=None
            if self.redis is None
            else MessageCensus(self.redis, Keys.of(settings), settings.lost_grace_s),
        )
        engine.start(preload=settings.preload)
        metrics.serve(settings, engine.holdings, engine.models)
        log.info("batchwork engine ready on %s", engine.device)
        return engine

    def _lease_renewal(self, consumer: Any, engine: Engine) -> LeaseRenewal:
        timeout_s = self.settings.visibility_timeout_s
        # The channel is looked up at every renewal: a reconnect brings a new one.
        channel = _CurrentChannel(consumer)
        return LeaseRenewal(channel, engine.holdings, timeout_s / 4, engine.stalled_s, timeout_s)

    def _gate(self, channel: Any, engine: Engine) -> None:
        if not hasattr(channel, "fetch"):
            return  # not batchwork's Redis transport (the in-memory broker of the embedded run)
        keys = Keys.of(self.settings)
        throttled = {keys.queue(priority): priority for priority in PRIORITIES[1:]}
        # An eighth of the prefetch window stays free for urgent messages whatever bulk holds.
        reserve = self.settings.prefetch_count // 8
        channel.fetch_gate = FetchThrottle(
            engine.holdings,
            self.settings.max_held_items,
            throttled,
            reserve,
            engine.stalled_s,
            engine.models.hold_goal,
        )


def startup_failure(exc: Exception) -> str | None:
    """The one line for what stopped a worker from starting (a device it does not have, a database away or
    not migrated, ...); None for anything else, a bug, which keeps its traceback."""
    from sqlalchemy.exc import DBAPIError

    from worker.errors import BatchworkError
    from worker.store.db import database_unavailable

    if isinstance(exc, BatchworkError):
        return str(exc)
    if isinstance(exc, DBAPIError):
        unavailable = database_unavailable(get_settings().database_url, exc)
        return None if unavailable is None else str(unavailable)
    return None


class _CurrentChannel:
    """The consumer's task channel as it is now (a reconnect replaces it)."""

    def __init__(self, consumer: Any) -> None:
        self._consumer = consumer

    def renew_leases(self, tags: list[str]) -> None:
        channel = celery_compat.task_channel(self._consumer)
        if hasattr(channel, "renew_leases"):
            channel.renew_leases(tags)


def _broker_redis(settings: Settings) -> Any:
    if settings.embedded:
        return None
    from worker.broker.producer import broker_redis

    return broker_redis(settings.broker_url)
