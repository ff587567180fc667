"""How each lane batches: N, T, token budget, length buckets, starvation bound, urgency.

Pure values and the rule that derives a lane's policy from a model's knobs and a priority;
nothing here reads settings or imports an edge of the system.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

PRIORITIES = ("high", "normal", "bulk")  # most urgent first


@dataclass(frozen=True, slots=True)
class LanePolicy:
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


@dataclass(frozen=True, slots=True)
class LaneKnobs:
    """What a user may set per model and priority; None keeps the derived default."""

    max_batch_size: int | None = None
    max_wait_ms: float | None = None
    max_delay_ms: float | None = None
    max_batch_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class ModelKnobs:
    max_batch_size: int
    max_wait_ms: float
    max_batch_tokens: int | None = None
    bucket_edges: tuple[int, ...] = ()
    lanes: Mapping[str, LaneKnobs] = field(default_factory=dict)


def default_lane(knobs: ModelKnobs, priority: str) -> LanePolicy:
    """The defaults: high rides small, fast batches; bulk waits longer for full ones; nothing starves.

    high: N/8 (at least 1), T at most 5 ms. normal: the model's N and T, served ahead of bulk once its
    oldest item waited 20 T (at least 1 s). bulk: the model's N, 4 T, ahead of all once it waited 40 T
    (at least 2 s), so an endless stream of urgent work still leaves bulk a batch within that bound.
    """
    base = LanePolicy(
        max_batch_size=knobs.max_batch_size,
        max_wait_s=knobs.max_wait_ms / 1000,
        rank=PRIORITIES.index(priority),
        max_batch_tokens=knobs.max_batch_tokens,
        bucket_edges=knobs.bucket_edges,
    )
    t = base.max_wait_s
    if priority == "high":
        return replace(base, max_batch_size=max(1, knobs.max_batch_size // 8), max_wait_s=min(t, 0.005))
    if priority == "normal":
        return replace(base, max_delay_s=max(20 * t, 1.0))
    return replace(base, max_wait_s=4 * t, max_delay_s=max(40 * t, 2.0))


def lane_policy(knobs: ModelKnobs, priority: str) -> LanePolicy:
    policy = default_lane(knobs, priority)
    lane = knobs.lanes.get(priority)
    if lane is None:
        return policy
    if lane.max_batch_size is not None:
        policy = replace(policy, max_batch_size=lane.max_batch_size)
    if lane.max_wait_ms is not None:
        policy = replace(policy, max_wait_s=lane.max_wait_ms / 1000)
    if lane.max_delay_ms is not None:
        policy = replace(policy, max_delay_s=lane.max_delay_ms / 1000)
    if lane.max_batch_tokens is not None:
        policy = replace(policy, max_batch_tokens=lane.max_batch_tokens)
    return policy
