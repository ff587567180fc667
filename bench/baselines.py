"""bench.pipeline's plain-Celery baselines (figure 2), on the bench's own servers (BENCH_BROKER_URL and
BENCH_DATABASE_URL, set by bench.harness): ``plain_store``, one task and one INSERT per item, as Celery is
usually written; ``batches_store``, celery-batches, one bulk INSERT per flush. Both acks_late, JSON.
"""

from __future__ import annotations

import os
from functools import cache

from celery import Celery
from celery_batches import Batches, SimpleRequest
from sqlalchemy import Column, DateTime, Engine, Integer, MetaData, Table, create_engine, text
from sqlalchemy.dialects import postgresql
from sqlalchemy.dialects.postgresql import JSONB

PLAIN_QUEUE, BATCHES_QUEUE = "bench.plain", "bench.batches"
FLUSH_EVERY, FLUSH_INTERVAL_S = 256, 0.05
NOOP = 0  # what batchwork's noop model answers for any item

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

# The bench's own redis-server: never a default that could reach another server.
app = Celery("bench_baselines", broker=os.environ["BENCH_BROKER_URL"])
app.conf.update(task_serializer="json", accept_content=["json"], task_ignore_result=True, task_acks_late=True,
                task_routes={"bench.plain_store": {"queue": PLAIN_QUEUE},
                             "bench.batches_store": {"queue": BATCHES_QUEUE}},
                broker_connection_retry_on_startup=True, worker_hijack_root_logger=True)  # fmt: skip


@cache
def engine(pid: int) -> Engine:
    """One pooled engine per process: a prefork child must not use the connections of its parent."""
    return create_engine(os.environ["BENCH_DATABASE_URL"], pool_pre_ping=True)


@app.task(name="bench.plain_store", acks_late=True)
def plain_store(index: int, item: str) -> None:
    with engine(os.getpid()).begin() as conn:
        conn.execute(INSERT_RESULT, {"item_index": index, "output": NOOP})


@app.task(name="bench.batches_store", base=Batches, flush_every=FLUSH_EVERY, flush_interval=FLUSH_INTERVAL_S,
          acks_late=True)  # fmt: skip
def batches_store(requests: list[SimpleRequest]) -> None:
    # One executemany: SQLAlchemy's insertmanyvalues sends it as multi-row INSERTs, in one transaction.
    with engine(os.getpid()).begin() as conn:
        conn.execute(INSERT_RESULT, [{"item_index": r.args[0], "output": NOOP} for r in requests])
