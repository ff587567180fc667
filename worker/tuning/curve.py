"""The batch curve: measured points of (N, length), which N to measure next, and the knee.

Pure arithmetic on measurements: the device is reached only through the ``measure`` callable a caller
passes in, so unit tests drive the sweep with made-up curves. Never imports torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np

KNEE_FRACTION = 0.9  # the knee: the smallest N reaching this share of the best throughput
# Triton Model Analyzer's stopping rule: the best of the last 4 points at most 5 % above the first of them.
PLATEAU_POINTS = 4
PLATEAU_GAIN = 0.05


@dataclass(frozen=True, slots=True)
class Point:
    """One batch size at one item length: its run times over repeated runs (warm-up excluded)."""

    n: int
    length: int  # tokens per item (1 for models without lengths)
    p50_ms: float
    p99_ms: float
    peak_bytes: int | None = None  # memory growth while it ran; None when the device cannot say
    oom: bool = False  # ran out of memory (caught); its times are meaningless
    runs: int = 0
    precision: str = "fp32"
    # A decode step of n running sequences (step models): it yields n tokens, and ``length`` is the
    # prompt's length, not tokens processed per item.
    step: bool = False

    @property
    def items_per_s(self) -> float:
        return 0.0 if self.oom or self.p50_ms <= 0 else self.n / self.p50_ms * 1000

    @property
    def tokens_per_s(self) -> float:
        return self.items_per_s if self.step else self.items_per_s * self.length


def point_from_runs(
    n: int, length: int, runs_ms: Sequence[float], peak_bytes: int | None, **kw: object
) -> Point:
    times = np.asarray(runs_ms, dtype=float)
    return Point(
        n,
        length,
        float(np.percentile(times, 50)),
        float(np.percentile(times, 99)),
        peak_bytes,
        runs=len(times),
        **kw,  # type: ignore[arg-type]
    )


def oom_point(n: int, length: int, precision: str = "fp32") -> Point:
    return Point(n, length, float("inf"), float("inf"), oom=True, precision=precision)


def plateaued(points: Sequence[Point]) -> bool:
    """Throughput stopped growing: the best of the last few points is barely above the first of them."""
    if len(points) < PLATEAU_POINTS:
        return False
    last = points[-PLATEAU_POINTS:]
    return max(p.items_per_s for p in last) <= (1 + PLATEAU_GAIN) * last[0].items_per_s


def knee(points: Iterable[Point]) -> Point | None:
    """The smallest N whose throughput reaches KNEE_FRACTION of the best (one length's points)."""
    ran = sorted((p for p in points if not p.oom), key=lambda p: p.n)
    if not ran:
        return None
    best = max(p.items_per_s for p in ran)
    return next(p for p in ran if p.items_per_s >= KNEE_FRACTION * best)


def bracket(points: Iterable[Point], bound_ms: float) -> tuple[Point | None, Point | None]:
    """The largest N within the bound below the smallest N over it (or out of memory)."""
    ordered = sorted(points, key=lambda p: p.n)
    over = next((p for p in ordered if p.oom or p.p99_ms > bound_ms), None)
    below = [p for p in ordered if not p.oom and p.p99_ms <= bound_ms and (over is None or p.n < over.n)]
    return (below[-1] if below else None), over


def sweep_length(measure: Callable[[int], Point], *, bounds_ms: Sequence[float], max_n: int) -> list[Point]:
    """One length's curve: N = 1, 2, 4, ... until two sizes in a row pass the largest bound (median),
    memory runs out or the throughput plateaus; then bisection where each lane's bound is crossed (to
    within an eighth of N) and below the knee (to within a quarter).
    """
    points: list[Point] = []
    n = 1
    while n <= max_n:
        point = measure(n)
        points.append(point)
        if point.oom or _past(points, max(bounds_ms)) or plateaued(points):
            break
        n *= 2
    for bound in sorted(bounds_ms):
        _bisect(points, measure, partial(_bound_gap, bound_ms=bound), fraction=8)
    _bisect(points, measure, _knee_gap, fraction=4)
    return sorted(points, key=lambda p: p.n)


def _past(points: Sequence[Point], bound_ms: float) -> bool:
    """The last two sizes both ran past ``bound_ms`` at the median: N is clearly past every bound.

    The median, and two sizes, because on a shared machine a burst of other work can slow every run of one
    point; a single such point would end the sweep before the sizes worth having.
    """
    return len(points) >= 2 and all(p.p50_ms > bound_ms for p in points[-2:])


def _bisect(
    points: list[Point],
    measure: Callable[[int], Point],
    gap: Callable[[list[Point]], tuple[int, int] | None],
    *,
    fraction: int,
) -> None:
    """Measure the middle of ``gap``'s span until it is within 1/``fraction`` of its lower end."""
    measured = {p.n for p in points}
    while (span := gap(points)) is not None:
        lo, hi = span
        middle = (lo + hi) // 2
        if hi - lo <= max(1, lo // fraction) or middle in measured:
            return
        points.append(measure(middle))
        measured.add(middle)


def _bound_gap(points: list[Point], bound_ms: float) -> tuple[int, int] | None:
    lo, hi = bracket(points, bound_ms)
    return None if lo is None or hi is None else (lo.n, hi.n)


def _knee_gap(points: list[Point]) -> tuple[int, int] | None:
    found = knee(points)
    if found is None:
        return None
    below = [p.n for p in points if p.n < found.n and not p.oom]
    return (max(below), found.n) if below else None
