"""The one Celery app: ``celery -A worker.celery_app worker|flower|inspect``.

JSON only, results in SQL (no result backend), one queue per priority consumed in priority
order, and the batching engine attached to every worker's consumer.
"""

from __future__ import annotations

from celery import Celery
from kombu import Queue

from worker.runtime.consumer import BatchingStep
from worker.runtime.loop import queue_name
from worker.settings import PRIORITIES, Settings, get_settings

queue_for = queue_name


def transport_options(settings: Settings) -> dict[str, object]:
    if settings.embedded:
        return {"polling_interval": 0.005}  # the in-memory broker polls; keep its latency low
    return {
        # A message unacked this long returns to its queue. Workers renew the messages they hold
        # (runtime/loop.py: LeaseRenewal), so this bounds how long a killed worker's messages wait.
        "visibility_timeout": settings.visibility_timeout_s,
        "unacked_restore_interval": 2,
        "unacked_restore_throttle": 1,
        "unacked_restore_limit": 1000,
        # BRPOP's timeout: a queue resumed after a pause (runtime/loop.py) is only polled once the
        # BRPOP in flight returns, so kombu's default of 1 s stalled intake for a second each time.
        "polling_interval": 0.1,
        # BRPOP checks the queues in the order the worker consumes them: high, normal, bulk.
        "queue_order_strategy": "priority",
        "socket_connect_timeout": 5,
        "health_check_interval": 10,
    }


def create_app(settings: Settings) -> Celery:
    app = Celery("batchwork", broker=settings.broker_url, include=["worker.tasks"])
    app.conf.update(
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        result_accept_content=["json"],
        task_ignore_result=True,
        task_queues=[Queue(queue_for(p, settings)) for p in PRIORITIES],
        task_default_queue=queue_for("normal", settings),
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
    app.steps["consumer"].add(BatchingStep)
    return app


app = create_app(get_settings())
