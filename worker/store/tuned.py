"""Tuned batching limits per model and device kind, the sizes that ran out of memory, and the batch
history `batchwork tune --from-history` fits.

Plain values in and out; it must never import the runtime, the scheduler or a model.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Engine, Insert, select
from sqlalchemy.dialects import postgresql, sqlite

from worker.store import bulk, tables
from worker.store.db import make_engine


@dataclass(frozen=True, slots=True)
class TunedRow:
    model: str
    device_kind: str
    batching: dict[str, Any] | None
    detail: dict[str, Any] | None
    tuned_at: datetime | None
    tuned_by: str | None
    oom_batch_size: int | None
    oom_at: datetime | None
    oom_worker: str | None


@dataclass(frozen=True, slots=True)
class BatchSample:
    """What one stored batch tells a fit: its lane, size, padded tokens, run time and start."""

    lane: str
    size: int
    padded_tokens: int
    run_ms: float
    started_at: datetime


class TunedLimits:
    """Reads and writes the tuned_limits table (and reads batches) through one Engine."""

    def __init__(self, engine: Engine) -> None:
        bulk.check_dialect(engine.dialect.name)
        self.engine = engine

    @classmethod
    def from_url(cls, url: str) -> TunedLimits:
        return cls(make_engine(url))

    def close(self) -> None:
        self.engine.dispose()

    def apply(
        self, model: str, device_kind: str, batching: dict[str, Any], detail: dict[str, Any], by: str
    ) -> None:
        """Store a recommendation; the out-of-memory record of the row, if any, stays."""
        values = {"batching": batching, "detail": detail, "tuned_at": _utcnow(), "tuned_by": by}
        self._upsert(model, device_kind, values)

    def record_out_of_memory(self, model: str, device_kind: str, size: int, worker: str) -> None:
        """A batch of ``size`` ran out of memory on a worker of this kind (the newest such size is kept)."""
        values = {"oom_batch_size": size, "oom_at": _utcnow(), "oom_worker": worker}
        self._upsert(model, device_kind, values)

    def rows(self, device_kind: str | None = None, model: str | None = None) -> list[TunedRow]:
        table = tables.tuned_limits
        query = select(table).order_by(table.c.model, table.c.device_kind)
        if device_kind is not None:
            query = query.where(table.c.device_kind == device_kind)
        if model is not None:
            query = query.where(table.c.model == model)
        with self.engine.connect() as conn:
            return [TunedRow(**row._mapping) for row in conn.execute(query)]

    def batches(self, model: str, since: timedelta, limit: int = 20_000) -> list[BatchSample]:
        """The model's newest stored batches of the last ``since``, newest first."""
        batch = tables.batches.c
        query = (
            select(batch.lane, batch.size, batch.padded_tokens, batch.run_ms, batch.started_at)
            .where(batch.model == model, batch.started_at >= _utcnow() - since)
            .order_by(batch.started_at.desc())
            .limit(limit)
        )
        with self.engine.connect() as conn:
            return [BatchSample(*row) for row in conn.execute(query)]

    def _upsert(self, model: str, device_kind: str, values: dict[str, Any]) -> None:
        row = {"model": model, "device_kind": device_kind, **values}
        with self.engine.begin() as conn:
            conn.execute(_upsert_statement(conn.dialect.name, list(values)), row)


def _upsert_statement(dialect: str, columns: list[str]) -> Insert:
    stmt = (postgresql if dialect == "postgresql" else sqlite).insert(tables.tuned_limits)
    return stmt.on_conflict_do_update(
        index_elements=["model", "device_kind"], set_={name: stmt.excluded[name] for name in columns}
    )


def _utcnow() -> datetime:
    return datetime.now(UTC)
