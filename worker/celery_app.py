"""The one Celery app: ``celery -A worker.celery_app worker|flower|inspect``.

JSON only; on Redis, batchwork's own transport (worker.broker.transport: many messages per round trip,
held with leases); one queue per priority, fetched in priority order; results in SQL, read through Celery's
own ``AsyncResult`` by a backend over the store; the batching engine attached to every worker's consumer,
named by path so that producers never import it.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any

from celery import Celery
from kombu import Queue

from worker.batching.policy import PRIORITIES
from worker.broker.keys import Keys
from worker.settings import Settings, get_settings


def transport_options(settings: Settings) -> dict[str, object]:
    if settings.embedded:
        return {"polling_interval": 0.005}  # the in-memory broker polls; keep its latency low
    return {
        "batchwork_prefix": settings.queue,
        # A held message whose lease is not renewed for this long returns to its queue. Workers renew
        # the messages they hold (runtime/outbox.py), so this bounds how long a killed worker's messages wait.
        "visibility_timeout": settings.visibility_timeout_s,
        "unacked_restore_interval": 2,
        "socket_connect_timeout": 5,
        "health_check_interval": 10,
    }


class BatchworkCelery(Celery):  # type: ignore[misc]  # celery ships no types
    @cached_property
    def AsyncResult(self) -> Any:  # noqa: N802  (Celery's name)
        """Results whose ``revoke()`` cancels the job (worker/celery_results.py), imported when first used."""
        return self.subclass_with_self("worker.celery_results:JobResult")


def create_app(settings: Settings) -> Celery:
    app = BatchworkCelery("batchwork", broker=settings.broker_url, include=["worker.tasks"])
    keys = Keys.of(settings)
    app.conf.update(
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        result_accept_content=["json"],
        task_ignore_result=True,
        # AsyncResult.state / .get() read jobs from the batchwork store; workers never write through it.
        result_backend="worker.celery_results:StoreBackend",
        task_queues=[Queue(keys.queue(p)) for p in PRIORITIES],
        task_default_queue=keys.queue("normal"),
        broker_transport_options=transport_options(settings),
        broker_connection_retry_on_startup=True,
        broker_connection_max_retries=None,
        # The engine runs models on its own threads; the pool would only hold idle processes.
        worker_pool="solo",
        worker_concurrency=1,
        worker_prefetch_multiplier=settings.prefetch_count,
        worker_send_task_events=settings.task_events,
        # Workers send received / started / succeeded for Flower; a "sent" event from producers
        # would double every publish, and it is the producer that bounds single-item calls.
        task_send_sent_event=False,
        worker_hijack_root_logger=False,
    )
    app.conf.broker_transport = (
        "worker.celery_compat:MemoryTransport" if settings.embedded else "worker.broker.transport:Transport"
    )
    app.steps["consumer"].add("worker.runtime.consumer:BatchingStep")
    return app


app = create_app(get_settings())
