"""Two plain-Celery baselines for bench.pipeline (figure 2), on the same Redis and PostgreSQL as batchwork.

``bench.plain_store`` is Celery as one usually writes it: one task per item that stores its one result
row (one INSERT, one transaction). ``bench.batches_store`` is a celery-batches task whose batch function
stores all its results in one bulk INSERT. Both ack late and speak JSON. Worker:
``celery -A bench.baselines worker -Q bench.plain`` (or ``-Q bench.batches``), configured through
BENCH_BROKER_URL, BENCH_DATABASE_URL (both set by bench.harness), BENCH_FLUSH_EVERY and
BENCH_FLUSH_INTERVAL_S, read here only.
"""

from __future__ import annotations

import os
from typing import Any

from celery import Celery
from celery_batches import Batches, SimpleRequest
from sqlalchemy import Column, DateTime, Engine, Integer, MetaData, Table, create_engine, text
from sqlalchemy.dialects import postgresql
from sqlalchemy.dialects.postgresql import JSONB

PLAIN_QUEUE = "bench.plain"
BATCHES_QUEUE = "bench.batches"

metadata = MetaData()
# clock_timestamp(): the time each row is written, so drain rates can be read back from the table.
results = Table(
    "bench_results",
    metadata,
    Column("item_index", Integer, primary_key=True, autoincrement=False),
    Column("output", JSONB, nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=text("clock_timestamp()")),
)
# ON CONFLICT: a redelivered message must not fail on its own earlier row (batchwork skips those too).
INSERT_RESULT = postgresql.insert(results).on_conflict_do_nothing(index_elements=["item_index"])

FLUSH_EVERY = int(os.environ.get("BENCH_FLUSH_EVERY", "256"))
FLUSH_INTERVAL_S = float(os.environ.get("BENCH_FLUSH_INTERVAL_S", "0.05"))

# Set by bench.harness (the bench's own redis-server): never a default that could reach another server.
app = Celery("bench_baselines", broker=os.environ["BENCH_BROKER_URL"])
app.conf.update(task_serializer="json", accept_content=["json"], task_ignore_result=True, task_acks_late=True,
                task_routes={"bench.plain_store": {"queue": PLAIN_QUEUE},
                             "bench.batches_store": {"queue": BATCHES_QUEUE}},
                broker_connection_retry_on_startup=True, worker_hijack_root_logger=True)  # fmt: skip

_engines: dict[int, Engine] = {}


def engine() -> Engine:
    """One pooled engine per process: a prefork child must not use the connections of its parent."""
    pid = os.getpid()
    if pid not in _engines:
        _engines[pid] = create_engine(os.environ["BENCH_DATABASE_URL"], pool_pre_ping=True)
    return _engines[pid]


def noop(item: str) -> int:
    """What batchwork's noop model answers for any item."""
    return 0


@app.task(name="bench.plain_store", acks_late=True)
def plain_store(index: int, item: str) -> None:
    with engine().begin() as conn:
        conn.execute(INSERT_RESULT, {"item_index": index, "output": noop(item)})


@app.task(name="bench.batches_store", base=Batches, flush_every=FLUSH_EVERY, flush_interval=FLUSH_INTERVAL_S,
          acks_late=True)  # fmt: skip
def batches_store(requests: list[SimpleRequest]) -> None:
    rows: list[dict[str, Any]] = [{"item_index": r.args[0], "output": noop(r.args[1])} for r in requests]
    # One executemany: SQLAlchemy's insertmanyvalues sends it as multi-row INSERTs, in one transaction.
    with engine().begin() as conn:
        conn.execute(INSERT_RESULT, rows)
