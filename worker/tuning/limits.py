"""A model's effective batching limits and where each came from: explicit BATCHWORK_BATCHING settings,
then the limits `batchwork tune --apply` stored for this device kind, then the model's own defaults.

Used by ``batchwork models`` and ``tune --from-history``; the layers are laid by the pure core's
``resolve_lane``, as a worker's lanes are. Reading the table never creates a database.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sqlalchemy.engine import make_url

from worker.batching.policy import PRIORITIES, LanePolicy, Source, limit_source, resolve_lane
from worker.models.base import Model
from worker.settings import BatchingSettings, Settings
from worker.store.tuned import TunedLimits, TunedRow

FIELDS = ("max_batch_size", "max_wait_ms", "max_batch_tokens")


@dataclass(frozen=True, slots=True)
class Effective:
    """A model's limits as a worker on this device kind runs them, per lane, and each field's source."""

    lanes: dict[str, LanePolicy]
    sources: dict[str, Source]  # field -> "setting" | "tuned" | "default"
    tuned: TunedRow | None

    @property
    def oom_flag(self) -> str | None:
        """A warning when a size at or above one that ran out of memory here is in use."""
        row = self.tuned
        if row is None or row.oom_batch_size is None:
            return None
        largest = max(policy.max_batch_size for policy in self.lanes.values())
        if largest < row.oom_batch_size:
            return None
        return f"N {largest} >= {row.oom_batch_size}, a batch size that ran out of memory on {row.oom_worker}"


def effective(name: str, cls: type[Model], settings: Settings, tuned: TunedRow | None) -> Effective:
    explicit = settings.batching.get(name)
    stored = BatchingSettings.model_validate(tuned.batching) if tuned is not None and tuned.batching else None
    return Effective(
        {lane: resolve_lane(cls.default_policy(), lane, explicit, stored) for lane in PRIORITIES},
        {field: limit_source(explicit, stored, field) for field in FIELDS},
        tuned,
    )


def read_tuned(database_url: str, device_kind: str) -> dict[str, TunedRow] | str:
    """The tuned rows of this device kind by model, or why they cannot be read (a reason, not an error:
    a database that is down or not migrated still leaves the defaults and settings to show)."""
    url = make_url(database_url)
    if url.get_backend_name() == "sqlite" and not Path(url.database or "").exists():
        return f"no database at {database_url}"
    store = TunedLimits.from_url(database_url)
    try:
        return {row.model: row for row in store.rows(device_kind=device_kind)}
    except Exception as exc:
        return f"tuned limits unreadable ({type(exc).__name__}; run `batchwork migrate`?)"
    finally:
        store.close()
