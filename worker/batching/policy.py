"""How each lane batches: N, T, token budget, length buckets, starvation bound, urgency.

Two shapes, one per stage: what a deployment chooses (``BATCHWORK_BATCHING``'s shape and the tuned limits
stored in it, defined with the settings; read here only through the ``Chosen`` protocol) and ``LanePolicy``,
what a lane runs by. The one resolution of a lane's policy lives here, ``resolve_lane``: explicit settings
over tuned limits over the model's own defaults, derived for the priority. The worker's lanes and
``batchwork models`` / ``tune`` both call it. Nothing here reads settings or imports an edge of the system.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Literal, Protocol

PRIORITIES = ("high", "normal", "bulk")  # most urgent first


@dataclass(frozen=True, slots=True)
class LanePolicy:
    """How one lane (a model at one priority) batches, every default and choice resolved."""

    max_batch_size: int  # N
    max_wait_s: float  # T, counted from the arrival of the lane's oldest waiting item
    rank: int = 0  # lower is more urgent; ties go to the lane whose oldest item waited longest
    # Padded tokens (longest item x batch size) a batch may hold; None: count items only.
    max_batch_tokens: int | None = None
    # Upper length bounds of the buckets; items longer than the last edge share one more bucket.
    bucket_edges: tuple[int, ...] = ()
    # Once the oldest item waited this long, this lane goes before any lane that has not (aging).
    max_delay_s: float | None = None
    # Continuous batching: items join a running batch one by one (``admit_next``), never by N or T.
    continuous: bool = False


class ChosenLane(Protocol):
    """What a deployment chose for one priority lane of a model; None keeps the derived default."""

    @property
    def max_batch_size(self) -> int | None: ...
    @property
    def max_wait_ms(self) -> float | None: ...
    @property
    def max_delay_ms(self) -> float | None: ...
    @property
    def max_batch_tokens(self) -> int | None: ...


class Chosen(Protocol):
    """What a deployment chose for a model (settings over tuned limits); None keeps the model's default."""

    @property
    def max_batch_size(self) -> int | None: ...
    @property
    def max_wait_ms(self) -> float | None: ...
    @property
    def max_batch_tokens(self) -> int | None: ...
    @property
    def bucket_edges(self) -> Sequence[int] | None: ...
    @property
    def lanes(self) -> Mapping[str, ChosenLane]: ...


@dataclass(frozen=True, slots=True)
class LaneLimits:
    """One lane's chosen values after layering (a ChosenLane); None keeps the derived default."""

    max_batch_size: int | None = None
    max_wait_ms: float | None = None
    max_delay_ms: float | None = None
    max_batch_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class Limits:
    """A model's chosen values after layering explicit settings over tuned limits (a Chosen)."""

    max_batch_size: int | None = None
    max_wait_ms: float | None = None
    max_batch_tokens: int | None = None
    bucket_edges: tuple[int, ...] | None = None
    lanes: Mapping[str, LaneLimits] = field(default_factory=dict)


Source = Literal["setting", "tuned", "default"]


def resolve_lane(
    defaults: LanePolicy, priority: str, explicit: Chosen | None = None, tuned: Chosen | None = None
) -> LanePolicy:
    """The policy of a model's lane at ``priority``: each value from the deployment's ``explicit`` settings,
    else the ``tuned`` limits (`batchwork tune --apply`), else the model's own ``defaults`` (as its normal
    lane has them), then derived for the priority (``lane_policy``)."""
    return lane_policy(defaults, priority, layered(explicit, tuned))


def layered(explicit: Chosen | None, tuned: Chosen | None) -> Limits:
    """``explicit`` laid over ``tuned``: each field from the first that sets it.

    A tuned lane value of a field yields to the same field set explicitly for the whole model, so an explicit
    model-level N also rules the lanes it derives (high's N/8) over tuned lane sizes.
    """
    mine, theirs = explicit or Limits(), tuned or Limits()
    lanes = {}
    for priority in PRIORITIES:
        lane = _lane_over(mine, mine.lanes.get(priority), theirs.lanes.get(priority))
        if lane != LaneLimits():
            lanes[priority] = lane
    edges = theirs.bucket_edges if mine.bucket_edges is None else mine.bucket_edges
    return Limits(
        max_batch_size=mine.max_batch_size or theirs.max_batch_size,
        max_wait_ms=theirs.max_wait_ms if mine.max_wait_ms is None else mine.max_wait_ms,
        max_batch_tokens=mine.max_batch_tokens or theirs.max_batch_tokens,
        bucket_edges=None if edges is None else tuple(edges),
        lanes=lanes,
    )


def limit_source(explicit: Chosen | None, tuned: Chosen | None, name: str) -> Source:
    """Which layer a model-level value (max_batch_size, max_wait_ms, ...) of ``resolve_lane`` comes from."""
    if explicit is not None and getattr(explicit, name) is not None:
        return "setting"
    return "tuned" if tuned is not None and getattr(tuned, name) is not None else "default"


def _lane_over(explicit: Chosen, mine: ChosenLane | None, theirs: ChosenLane | None) -> LaneLimits:
    values = {}
    for name in (f.name for f in fields(LaneLimits)):
        value = None if mine is None else getattr(mine, name)
        if value is None and theirs is not None and getattr(explicit, name, None) is None:
            value = getattr(theirs, name)
        values[name] = value
    return LaneLimits(**values)


def lane_policy(model: LanePolicy, priority: str, chosen: Chosen | None = None) -> LanePolicy:
    """The policy of ``model``'s lane at ``priority``: the model's own N, T, budget and buckets (``model``,
    as its normal lane has them), under the deployment's ``chosen`` values, derived for the priority.

    The derivation: high rides small, fast batches (N/8, at least 1; T at most 5 ms); normal keeps N and T
    and goes ahead of bulk once its oldest item waited 20 T (at least 1 s); bulk keeps N, waits 4 T, and goes
    ahead of all once it waited 40 T (at least 2 s), so an endless stream of urgent work still leaves bulk a
    batch within that bound. Values chosen for the lane itself replace the derived ones.
    """
    base = model if chosen is None else _chosen_for_model(model, chosen)
    policy = _derived(replace(base, rank=PRIORITIES.index(priority)), priority)
    lane = None if chosen is None else chosen.lanes.get(priority)
    if lane is None:
        return policy
    return replace(
        policy,
        max_batch_size=lane.max_batch_size or policy.max_batch_size,
        max_wait_s=policy.max_wait_s if lane.max_wait_ms is None else lane.max_wait_ms / 1000,
        max_delay_s=policy.max_delay_s if lane.max_delay_ms is None else lane.max_delay_ms / 1000,
        max_batch_tokens=lane.max_batch_tokens or policy.max_batch_tokens,
    )


def _chosen_for_model(model: LanePolicy, chosen: Chosen) -> LanePolicy:
    return replace(
        model,
        max_batch_size=chosen.max_batch_size or model.max_batch_size,
        max_wait_s=model.max_wait_s if chosen.max_wait_ms is None else chosen.max_wait_ms / 1000,
        max_batch_tokens=chosen.max_batch_tokens or model.max_batch_tokens,
        bucket_edges=model.bucket_edges
        if chosen.bucket_edges is None
        else tuple(sorted(chosen.bucket_edges)),
    )


def _derived(base: LanePolicy, priority: str) -> LanePolicy:
    t = base.max_wait_s
    if priority == "high":
        return replace(base, max_batch_size=max(1, base.max_batch_size // 8), max_wait_s=min(t, 0.005))
    if priority == "normal":
        return replace(base, max_delay_s=max(20 * t, 1.0))
    return replace(base, max_wait_s=4 * t, max_delay_s=max(40 * t, 2.0))
