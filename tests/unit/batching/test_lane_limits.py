"""The one resolution of a lane's batching limits (worker/batching/policy.py, resolve_lane): explicit
settings over tuned limits over the model's own defaults, field by field, then derived for the priority.
The worker's lanes and `batchwork models` / `tune` both go through it."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from worker.batching.policy import LaneLimits, LanePolicy, Limits, layered, limit_source, resolve_lane
from worker.settings import BatchingSettings, LaneSettings

DEFAULTS = LanePolicy(max_batch_size=64, max_wait_s=0.050, max_batch_tokens=4096, bucket_edges=(8, 16))
TUNED = BatchingSettings(
    max_batch_size=80,
    max_wait_ms=30,
    max_batch_tokens=2048,
    bucket_edges=[16, 32],
    lanes={"high": LaneSettings(max_batch_size=12), "bulk": LaneSettings(max_delay_ms=900)},
)


def test_explicit_settings_go_over_tuned_limits_field_by_field() -> None:
    tuned = BatchingSettings(
        max_batch_size=80,
        max_wait_ms=30,
        max_batch_tokens=2048,
        lanes={"high": LaneSettings(max_batch_size=12)},
    )
    assert layered(BatchingSettings(), tuned) == Limits(80, 30, 2048, None, {"high": LaneLimits(12)})
    mine = layered(BatchingSettings(max_wait_ms=5), tuned)
    assert (mine.max_batch_size, mine.max_wait_ms, mine.max_batch_tokens) == (80, 5, 2048)
    # An explicit model-level N rules the lanes it derives: the tuned high N yields to it.
    assert layered(BatchingSettings(max_batch_size=64), tuned).lanes == {}
    assert limit_source(BatchingSettings(), tuned, "max_batch_size") == "tuned"
    assert limit_source(BatchingSettings(max_batch_size=64), tuned, "max_batch_size") == "setting"
    assert limit_source(BatchingSettings(), BatchingSettings(), "max_batch_size") == "default"
    assert limit_source(None, None, "max_batch_size") == "default"


# (explicit, tuned) -> the normal lane's (N, T in ms, token budget, bucket edges) and N's source.
PRECEDENCE = [
    (None, None, (64, 50.0, 4096, (8, 16)), "default"),
    (BatchingSettings(), BatchingSettings(), (64, 50.0, 4096, (8, 16)), "default"),
    (None, TUNED, (80, 30.0, 2048, (16, 32)), "tuned"),
    (BatchingSettings(max_batch_size=32), TUNED, (32, 30.0, 2048, (16, 32)), "setting"),
    (BatchingSettings(max_batch_size=32), None, (32, 50.0, 4096, (8, 16)), "setting"),
    # 0 ms and no buckets are choices, not gaps: they go over the tuned values.
    (BatchingSettings(max_wait_ms=0, bucket_edges=[]), TUNED, (80, 0.0, 2048, ()), "tuned"),
    (BatchingSettings(max_batch_tokens=512, bucket_edges=[64, 8]), TUNED, (80, 30.0, 512, (8, 64)), "tuned"),
]


@pytest.mark.parametrize(("explicit", "tuned", "expected", "source"), PRECEDENCE)
def test_each_value_comes_from_the_first_layer_that_sets_it(
    explicit: BatchingSettings | None,
    tuned: BatchingSettings | None,
    expected: tuple[int, float, int, tuple[int, ...]],
    source: str,
) -> None:
    lane = resolve_lane(DEFAULTS, "normal", explicit, tuned)
    assert (lane.max_batch_size, lane.max_wait_s * 1000, lane.max_batch_tokens, lane.bucket_edges) == expected
    assert limit_source(explicit, tuned, "max_batch_size") == source


def test_lane_values_go_over_model_values_and_a_model_level_choice_rules_its_lanes() -> None:
    # The tuned high N (12) beats the derived N/8 (80 // 8 = 10) ...
    assert resolve_lane(DEFAULTS, "high", None, TUNED).max_batch_size == 12
    # ... but yields to an explicit model-level N, from which high derives its own (32 // 8).
    assert resolve_lane(DEFAULTS, "high", BatchingSettings(max_batch_size=32), TUNED).max_batch_size == 4
    # A value chosen for the lane itself goes over everything.
    explicit = BatchingSettings(max_batch_size=32, lanes={"high": LaneSettings(max_batch_size=3)})
    assert resolve_lane(DEFAULTS, "high", explicit, TUNED).max_batch_size == 3
    # A lane field with no model-level twin (the starvation bound) keeps the tuned value under explicit
    # model-level settings.
    bulk = resolve_lane(DEFAULTS, "bulk", BatchingSettings(max_batch_size=32, max_wait_ms=5), TUNED)
    assert bulk.max_delay_s == pytest.approx(0.9)
    assert bulk.max_wait_s == pytest.approx(4 * 0.005)  # bulk waits 4 T of the explicit T


def test_the_priority_derivation_applies_to_the_resolved_values() -> None:
    high, normal, bulk = (resolve_lane(DEFAULTS, p, None, TUNED) for p in ("high", "normal", "bulk"))
    assert high.rank < normal.rank < bulk.rank
    assert (high.max_wait_s, normal.max_wait_s, bulk.max_wait_s) == pytest.approx((0.005, 0.030, 0.120))
    assert normal.max_delay_s == pytest.approx(1.0)  # 20 T is 0.6 s: at least 1 s
    assert resolve_lane(DEFAULTS, "normal") == resolve_lane(DEFAULTS, "normal", BatchingSettings(), None)


sizes = st.none() | st.integers(min_value=1, max_value=4096)
waits = st.none() | st.floats(min_value=0, max_value=10_000, allow_nan=False)


@given(mine_n=sizes, tuned_n=sizes, mine_t=waits, tuned_t=waits)
def test_the_first_layer_that_sets_a_value_wins(
    mine_n: int | None, tuned_n: int | None, mine_t: float | None, tuned_t: float | None
) -> None:
    explicit = BatchingSettings(max_batch_size=mine_n, max_wait_ms=mine_t)
    tuned = BatchingSettings(max_batch_size=tuned_n, max_wait_ms=tuned_t)
    lane = resolve_lane(DEFAULTS, "normal", explicit, tuned)
    first_n = next(v for v in (mine_n, tuned_n, DEFAULTS.max_batch_size) if v is not None)
    first_t = next(v for v in (mine_t, tuned_t, DEFAULTS.max_wait_s * 1000) if v is not None)
    assert lane.max_batch_size == first_n
    assert lane.max_wait_s == pytest.approx(first_t / 1000)
    assert resolve_lane(DEFAULTS, "high", explicit, tuned).max_batch_size == max(1, first_n // 8)
