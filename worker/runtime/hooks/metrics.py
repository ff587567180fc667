"""A worker's Prometheus metrics: every metric object, the engine's hook that counts batches and stored
items, the consumer's count of redelivered messages, and the server.

One call per batch, write or message (a write's items are tallied in one pass, then counted once per label
set); the items held, running sequences and preemptions are read only when Prometheus scrapes. Nothing here
blocks or does I/O on the work's threads.
"""

from __future__ import annotations

import logging
from collections import Counter as Tally
from collections.abc import Iterator, Sequence

from prometheus_client import REGISTRY, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from worker.batching.policy import PRIORITIES
from worker.runtime.deliveries import Holdings, Message, ResultsToStore
from worker.runtime.forward import Report
from worker.runtime.hooks import Hook, Ran, Run
from worker.runtime.loaded_models import LoadedModels
from worker.settings import Settings
from worker.store.values import BatchRecord

log = logging.getLogger(__name__)

_BY_LANE = ["model", "lane"]

ITEMS = Counter(
    "batchwork_items_total",
    "Items whose outcome this worker stored, by outcome (ok, error); a redelivered item counts again",
    [*_BY_LANE, "outcome"],
)
BATCHES = Counter(
    "batchwork_batches_total",
    "Batches run, by outcome (ok, or error: some item failed)",
    [*_BY_LANE, "outcome"],
)
BATCH_SIZE = Histogram(
    "batchwork_batch_size_items",
    "Items per batch",
    _BY_LANE,
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048),
)
PADDED_FRACTION = Histogram(
    "batchwork_batch_padded_token_fraction",
    "Share of a batch's tokens that are padding ((padded - real) / padded)",
    _BY_LANE,
    buckets=(0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0),
)
QUEUE_WAIT = Histogram(
    "batchwork_queue_wait_seconds",
    "How long a batch's oldest item waited in the worker before the batch ran",
    _BY_LANE,
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
RUN_TIME = Histogram(
    "batchwork_batch_run_seconds",
    "A batch's forward pass (with any splits for errors or out of memory)",
    _BY_LANE,
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
OOM_SPLITS = Counter("batchwork_oom_splits_total", "Batches split because they ran out of memory", ["model"])
REDELIVERED = Counter(
    "batchwork_redelivered_deliveries_total",
    "Messages received again after the worker holding them died (their lease ran out)",
)


def delivered(message: Message) -> None:
    """A message arrived (consumer)."""
    if message.properties.get("batchwork_lost"):
        REDELIVERED.inc()


def batch_ran(record: BatchRecord, report: Report) -> None:
    """A batch ran on the model (run thread)."""
    lane = (record.model, record.lane)
    failed = report.failed
    BATCHES.labels(*lane, "error" if failed else "ok").inc()
    BATCH_SIZE.labels(*lane).observe(record.size)
    if record.padded_tokens > 0:
        PADDED_FRACTION.labels(*lane).observe(1 - record.real_tokens / record.padded_tokens)
    QUEUE_WAIT.labels(*lane).observe(record.wait_ms / 1000)
    RUN_TIME.labels(*lane).observe(record.run_ms / 1000)
    if report.out_of_memory_at is not None:
        OOM_SPLITS.labels(record.model).inc()


def items_stored(write: ResultsToStore) -> None:
    """A write's outcomes were committed (store thread)."""
    tally: Tally[tuple[str, str, str]] = Tally()
    errors, start = write.columns.errors, 0
    for delivery, count in write.runs:
        call = delivery.call
        if call is not None:
            failed = count - errors[start : start + count].count(None)
            tally[call.model, call.priority, "ok"] += count - failed
            tally[call.model, call.priority, "error"] += failed
        start += count
    for labels, count in tally.items():
        if count:
            ITEMS.labels(*labels).inc(count)


class Metrics(Hook):
    def after_batch(self, runs: Sequence[Run], ran: Ran | None) -> None:
        if ran is not None:
            batch_ran(ran.record, ran.report)

    def after_store(self, write: ResultsToStore) -> None:
        items_stored(write)


class WorkerState(Collector):
    """Gauges read from the engine when Prometheus scrapes, so the hot path pays nothing for them."""

    def __init__(self, holdings: Holdings, models: LoadedModels) -> None:
        self.holdings = holdings
        self.models = models

    def collect(self) -> Iterator[Metric]:
        held = GaugeMetricFamily(
            "batchwork_items_held", "Items received and not yet stored, by lane", labels=["lane"]
        )
        for priority in PRIORITIES:
            held.add_metric([priority], self.holdings.items(priority))
        yield held
        running = GaugeMetricFamily(
            "batchwork_running_sequences", "Sequences admitted to a step model", labels=["model"]
        )
        preempted = CounterMetricFamily(
            "batchwork_preemptions", "Sequences preempted for lack of KV cache", labels=["model"]
        )
        for name, model in self.models.steppers():
            running.add_metric([name], model.running())
            preempted.add_metric([name], getattr(model, "preemptions", 0))
        yield running
        yield preempted


_state: WorkerState | None = None


def serve(settings: Settings, holdings: Holdings, models: LoadedModels) -> None:
    """Serve /metrics on ``settings.metrics_port`` (consumer, once the engine is up); not for the
    embedded run, and a port already taken costs a warning, not the worker."""
    global _state
    if settings.embedded or settings.metrics_port == 0:
        return
    if _state is None:
        _state = WorkerState(holdings, models)
        REGISTRY.register(_state)
    else:  # a second engine in this process (tests): report the newest
        _state.holdings, _state.models = holdings, models
    try:
        start_http_server(settings.metrics_port)
    except OSError as exc:
        log.warning(
            "metrics not served: port %d: %s (set BATCHWORK_METRICS_PORT)", settings.metrics_port, exc
        )
        return
    log.info("metrics on :%d/metrics", settings.metrics_port)
