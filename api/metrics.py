"""The API's own Prometheus metrics: requests by route and status, their latency, and the broker's queue
depth per lane (read from Redis when Prometheus scrapes).

One registry per app, so several apps in one process (tests) never collide. A failing read of the queue
depth drops that metric from the scrape; it never fails the scrape or a request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.backend import Backend

log = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class QueueDepth(Collector):
    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    def collect(self) -> Iterator[Metric]:
        try:
            depth = self.backend.queue_depth()
        except Exception as exc:  # the broker is down: say so in the log, scrape the rest
            log.warning("queue depth not read: %s", exc)
            return
        gauge = GaugeMetricFamily(
            "batchwork_queue_depth_messages", "Messages waiting in the broker, by lane", labels=["lane"]
        )
        for lane, messages in depth.items():
            gauge.add_metric([lane], messages)
        yield gauge


class ApiMetrics:
    def __init__(self, backend: Backend) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "batchwork_api_requests_total",
            "HTTP requests answered, by route template, method and status code",
            ["route", "method", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "batchwork_api_request_seconds",
            "Time from a request's start to its response's last byte, by route template and method",
            ["route", "method"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(QueueDepth(backend))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def observe(self, route: str, method: str, status: int, seconds: float) -> None:
        self.requests.labels(route, method, str(status)).inc()
        self.latency.labels(route, method).observe(seconds)


class RequestMetrics:
    """ASGI middleware timing every HTTP request to its last byte (streamed results included).

    Labelled by the matched route's template (``/v1/jobs/{job_id}``), never the raw path, so job ids do not
    become label values.
    """

    def __init__(self, app: ASGIApp, metrics: ApiMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500  # unless a response starts

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            self.metrics.observe(route, scope["method"], status, time.perf_counter() - started)
