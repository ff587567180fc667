"""The outcome of a sweep: the JSON result a person or a script reads, the history it draws T from,
and ``--apply``, which stores the choice where every worker of the device kind reads it.
"""

from __future__ import annotations

import getpass
import socket
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from worker.batching.policy import PRIORITIES, resolve_lane
from worker.models.base import Model
from worker.settings import Settings
from worker.tuning.choice import LaneChoice, as_batching_settings, knees
from worker.tuning.curve import Point
from worker.tuning.history import arrival_per_s
from worker.tuning.limits import read_tuned
from worker.tuning.request import TuneError, TuneRequest

ARRIVAL_WINDOW = timedelta(hours=1)  # the history the fill time T is read from


def read_history(settings: Settings, model: str, kind: str) -> tuple[dict[str, float], Any]:
    """Arrival rate per lane over the last hour of stored batches, and this model's tuned row."""
    tuned = read_tuned(settings.database_url, kind)
    if isinstance(tuned, str):
        return {}, None
    from worker.store.tuned import TunedLimits

    store = TunedLimits.from_url(settings.database_url)
    try:
        rows = store.batches(model, ARRIVAL_WINDOW)
    finally:
        store.close()
    rates: dict[str, float] = {}
    for lane in PRIORITIES:
        mine = [row for row in rows if row.lane == lane]
        rate = arrival_per_s([r.size for r in mine], [r.started_at.timestamp() for r in mine])
        if rate:
            rates[lane] = rate
    return rates, tuned.get(model)


def build_result(
    request: TuneRequest,
    cls: type[Model],
    device: str,
    kind: str,
    precision: str,
    memory_cap: int | None,
    lanes: dict[str, LaneChoice],
    points: Sequence[Point],
    tuned: Any,
) -> dict[str, Any]:
    lane_rows = {name: lane_row(choice, cls) for name, choice in lanes.items()}
    normal = lane_rows["normal"]
    warnings = [
        f"lane {name}: no batch size met the {row['bound_ms']:g} ms bound"
        for name, row in lane_rows.items()
        if row["max_batch_size"] is None
    ]
    warnings += [
        f"lane {name}: a length met the {row['bound_ms']:g} ms bound at no size ({row['p99_batch_ms']} ms)"
        for name, row in lane_rows.items()
        if row["p99_batch_ms"] is not None and row["p99_batch_ms"] > row["bound_ms"]
    ]
    oom = None if tuned is None else tuned.oom_batch_size
    largest = max((row["max_batch_size"] or 0) for row in lane_rows.values())
    if oom is not None and largest >= oom:
        warnings.append(
            f"N {largest} is at or above {oom}, a batch size that ran out of memory on {tuned.oom_worker}"
        )
    return {
        "model": request.model,
        "device": device,
        "device_kind": kind,
        "precision": precision,
        "max_batch_ms": request.max_batch_ms,
        "memory_cap_bytes": memory_cap,
        **{
            key: normal[key]
            for key in ("max_batch_size", "max_batch_tokens", "max_wait_ms", "p99_batch_ms", "items_per_s")
        },
        "lengths": sorted({p.length for p in points}),
        "knee": {str(length): n for length, n in knees(points).items()},
        "lanes": lane_rows,
        "oom_batch_size": oom,
        "warnings": warnings,
        "points": len(points),
        "applied": request.apply,
    }


def lane_row(choice: LaneChoice, cls: type[Model]) -> dict[str, Any]:
    default_wait_ms = resolve_lane(cls.default_policy(), choice.lane).max_wait_s * 1000
    return {
        "bound_ms": choice.bound_ms,
        "max_batch_size": choice.max_batch_size,
        "max_batch_tokens": choice.max_batch_tokens,
        "max_wait_ms": default_wait_ms if choice.max_wait_ms is None else choice.max_wait_ms,
        "max_wait_from": "default" if choice.max_wait_ms is None else "history",
        "p99_batch_ms": None if choice.p99_batch_ms is None else round(choice.p99_batch_ms, 2),
        "items_per_s": None if choice.items_per_s is None else round(choice.items_per_s, 1),
        "length": choice.length,
        "per_length": {str(length): n for length, n in choice.per_length.items()},
    }


def apply_choice(
    settings: Settings, model: str, kind: str, lanes: dict[str, LaneChoice], result: dict[str, Any]
) -> None:
    from worker.store.schema import migrate
    from worker.store.tuned import TunedLimits

    if any(choice.max_batch_size is None for choice in lanes.values()):
        raise TuneError("--apply: some lane has no batch size within its bound; raise --max-batch-ms")
    if settings.database_url.startswith("sqlite"):
        migrate(settings.database_url)  # the embedded run's database is created on first use
    store = TunedLimits.from_url(settings.database_url)
    keys = ("max_batch_ms", "precision", "memory_cap_bytes", "lanes", "knee", "backend")
    detail = {key: result[key] for key in keys if key in result}
    try:
        store.apply(
            model, kind, as_batching_settings(lanes), detail, f"{getpass.getuser()}@{socket.gethostname()}"
        )
    except Exception as exc:
        raise TuneError(
            f"--apply: could not store the limits ({type(exc).__name__}: {exc}); run `batchwork migrate`?"
        ) from None
    finally:
        store.close()
