"""The recommendation: per lane, the N and token budget with the most throughput within a latency bound
and a memory cap, and the T that fills such a batch at the arrival rate production showed.

Pure arithmetic on measured points (worker.tuning.curve); never imports torch or touches a database.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial

from worker.batching.policy import PRIORITIES
from worker.tuning.curve import Point, knee

DEFAULT_MAX_BATCH_MS = 200.0
# A lane's bound on one batch's p99 run time, as a share of --max-batch-ms: high rides small, fast batches
# (its items are waited for), bulk large ones (only throughput matters, within reason).
LANE_BOUND_FACTORS = {"high": 0.25, "normal": 1.0, "bulk": 4.0}
MIN_WAIT_MS = 1.0


def lane_bounds(max_batch_ms: float) -> dict[str, float]:
    return {lane: max_batch_ms * LANE_BOUND_FACTORS[lane] for lane in PRIORITIES}


@dataclass(frozen=True, slots=True)
class LaneChoice:
    """One lane's limits; None where nothing met the bound (or, for T, where there was no history)."""

    lane: str
    bound_ms: float
    max_batch_size: int | None
    max_batch_tokens: int | None
    max_wait_ms: float | None
    p99_batch_ms: float | None  # the worst of the lengths' p99 at the sizes these limits give them
    items_per_s: float | None  # at the reference length
    length: int  # the reference length (the median representative length)
    per_length: Mapping[int, int] = field(default_factory=dict)  # length -> N that length's batches get


def feasible(point: Point, bound_ms: float, memory_cap_bytes: int | None) -> bool:
    if point.oom or point.p99_ms > bound_ms:
        return False
    return memory_cap_bytes is None or point.peak_bytes is None or point.peak_bytes <= memory_cap_bytes


def by_length(points: Sequence[Point]) -> dict[int, list[Point]]:
    curves: dict[int, list[Point]] = {}
    for point in sorted(points, key=lambda p: (p.length, p.n)):
        curves.setdefault(point.length, []).append(point)
    return curves


def choose_lane(
    lane: str,
    points: Sequence[Point],
    bound_ms: float,
    memory_cap_bytes: int | None,
    arrival_per_s: float | None = None,
) -> LaneChoice:
    """The count cap N from the shortest length's best point; the token budget as large as the lengths'
    best points want, but never so large that a length runs a batch over the bound.

    A batch of items of length L holds min(N, budget // L) of them, so the budget is cut wherever the
    point measured for that size (the nearest at or above it) is over the bound.
    """
    curves = {length: monotone(curve) for length, curve in by_length(points).items()}
    reference = sorted(curves)[len(curves) // 2]
    best: dict[int, Point] = {}
    for length, curve in curves.items():
        ok = [p for p in curve if feasible(p, bound_ms, memory_cap_bytes)]
        if ok:
            best[length] = max(ok, key=lambda p: (p.items_per_s, -p.n))
    shortest = min(curves)
    if shortest not in best:
        return LaneChoice(lane, bound_ms, None, None, None, None, None, reference)
    n = best[shortest].n
    fits = partial(feasible, bound_ms=bound_ms, memory_cap_bytes=memory_cap_bytes)
    budget = (
        _token_budget(n, best, {length: curves[length] for length in best}, fits) if max(curves) > 1 else None
    )
    sizes = {length: _size_at(n, budget, length) for length in curves}
    used = {length: _measured_at(curves[length], size) for length, size in sizes.items()}
    p99 = max((p.p99_ms for p in used.values() if p is not None), default=None)
    at_reference = used.get(reference)
    return LaneChoice(
        lane,
        bound_ms,
        n,
        budget,
        fill_wait_ms(n, arrival_per_s, bound_ms),
        p99,
        None if at_reference is None else at_reference.items_per_s,
        reference,
        sizes,
    )


def _token_budget(
    n: int, best: Mapping[int, Point], curves: Mapping[int, Sequence[Point]], fits: Callable[[Point], bool]
) -> int:
    """The largest budget the lengths' best points want, lowered until every length's batch size lands
    on a point within the bound. Lengths that met the bound at no size are left out: nothing helps them."""
    budget = max(point.n * length for length, point in best.items())
    lowered = True
    while lowered:
        lowered = False
        for length, curve in curves.items():
            size = _size_at(n, budget, length)
            point = _measured_at(curve, size)
            if point is None or fits(point):
                continue
            smaller = [p.n for p in curve if p.n < size and fits(p)]
            if smaller and max(smaller) * length < budget:
                budget, lowered = max(smaller) * length, True
    return budget


def monotone(curve: Sequence[Point]) -> list[Point]:
    """One length's points with each time replaced by the least time of any batch at least as large.

    A batch of n items never costs more than one of more items of the same length, so a slower reading
    at a smaller size is interference (this repository's dev box is shared): on such a machine one slow
    run among a few is the p99. The CSV keeps the raw readings.
    """
    ran = sorted((p for p in curve if not p.oom), key=lambda p: p.n)
    cleaned: list[Point] = []
    p50 = p99 = float("inf")
    for point in reversed(ran):
        p50, p99 = min(p50, point.p50_ms), min(p99, point.p99_ms)
        cleaned.append(replace(point, p50_ms=p50, p99_ms=p99))
    return sorted([*cleaned, *(p for p in curve if p.oom)], key=lambda p: p.n)


def _size_at(n: int, budget: int | None, length: int) -> int:
    return n if budget is None else max(1, min(n, budget // length))


def _measured_at(curve: Sequence[Point], size: int) -> Point | None:
    """The measured point that stands for a batch of ``size``: the nearest one at or above it."""
    above = [p for p in curve if p.n >= size]
    return min(above, key=lambda p: p.n) if above else max(curve, key=lambda p: p.n, default=None)


def fill_wait_ms(n: int, arrival_per_s: float | None, bound_ms: float) -> float | None:
    """How long until ``n`` items arrive at the observed rate, within [1 ms, the lane's bound]."""
    if not arrival_per_s or arrival_per_s <= 0:
        return None
    return round(min(bound_ms, max(MIN_WAIT_MS, n / arrival_per_s * 1000)), 1)


def knees(points: Sequence[Point]) -> dict[int, int]:
    """Per length, the knee's N (see curve.knee)."""
    found = {length: knee(monotone(curve)) for length, curve in by_length(points).items()}
    return {length: point.n for length, point in found.items() if point is not None}


def choose(
    points: Sequence[Point],
    max_batch_ms: float,
    memory_cap_bytes: int | None,
    arrival_per_s: Mapping[str, float] | None = None,
) -> dict[str, LaneChoice]:
    rates = arrival_per_s or {}
    return {
        lane: choose_lane(lane, points, bound, memory_cap_bytes, rates.get(lane))
        for lane, bound in lane_bounds(max_batch_ms).items()
    }


def as_batching_settings(lanes: Mapping[str, LaneChoice]) -> dict[str, object]:
    """The choice in BATCHWORK_BATCHING's shape: normal's limits for the model, the others per lane."""
    normal = lanes["normal"]
    settings: dict[str, object] = _limits(normal)
    settings["lanes"] = {name: _limits(choice) for name, choice in lanes.items() if name != "normal"}
    return settings


def _limits(choice: LaneChoice) -> dict[str, object]:
    values = {
        "max_batch_size": choice.max_batch_size,
        "max_batch_tokens": choice.max_batch_tokens,
        "max_wait_ms": choice.max_wait_ms,
    }
    return {key: value for key, value in values.items() if value is not None}
