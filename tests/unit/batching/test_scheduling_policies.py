"""Bucketed batching, token budgets, priority lanes and aging in the pure core, under a fake clock."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from worker.batching.policy import LanePolicy, lane_policy
from worker.batching.scheduler import Item, Scheduler
from worker.settings import BatchingSettings, LaneSettings

BUCKETED = LanePolicy(max_batch_size=4, max_wait_s=0.1, max_batch_tokens=64, bucket_edges=(8, 16, 32))


def one_lane(policy: LanePolicy) -> Scheduler:
    return Scheduler(lambda key: policy)


def add(s: Scheduler, lengths: list[int], at: float = 0.0, job: str = "j", start: int = 0) -> None:
    for i, length in enumerate(lengths, start=start):
        s.add("m", "normal", Item(job, i, length, at))


def lengths_of(s: Scheduler, now: float) -> list[int] | None:
    batch = s.next_batch(now)
    return None if batch is None else [item.length for item in batch.items]


def test_a_full_bucket_goes_at_once_and_holds_only_similar_lengths() -> None:
    s = one_lane(BUCKETED)
    add(s, [3, 30, 5, 28, 7, 2])
    assert lengths_of(s, now=0.0) == [3, 5, 7, 2]  # the short bucket filled N=4
    assert lengths_of(s, now=0.0) is None  # the two long ones wait for company or T


def test_the_deadline_still_holds_for_a_thin_bucket_topped_up_from_its_neighbours() -> None:
    s = one_lane(BUCKETED)
    add(s, [30], at=0.0)  # alone in the 17..32 bucket
    add(s, [12, 6], at=0.05, start=1)
    assert lengths_of(s, now=0.0999) is None
    # At T the oldest item goes, and the nearest bucket (9..16) tops the batch up before 1..8.
    assert lengths_of(s, now=0.1) == [30, 12]  # 6 would need 3 x 30 = 90 > 64 tokens


def test_the_token_budget_makes_long_items_ride_smaller_batches() -> None:
    policy = replace(BUCKETED, max_batch_size=100, bucket_edges=())
    s = one_lane(policy)
    add(s, [30] * 5 + [4] * 20)
    assert lengths_of(s, now=0.0) == [30, 30]  # 3 x 30 would pass 64
    assert lengths_of(s, now=0.0) == [30, 30]


def test_an_item_longer_than_the_budget_runs_alone() -> None:
    s = one_lane(BUCKETED)
    add(s, [500, 500, 3])
    assert lengths_of(s, now=0.0) == [500]
    assert lengths_of(s, now=0.0) == [500]
    assert lengths_of(s, now=0.1) == [3]


def test_batch_counts_real_and_padded_tokens() -> None:
    s = one_lane(BUCKETED)
    add(s, [9, 16, 12, 10])
    batch = s.next_batch(0.0)
    assert batch is not None and (batch.real_tokens, batch.padded_tokens) == (47, 64)


def three_lanes() -> Scheduler:
    model = LanePolicy(max_batch_size=16, max_wait_s=0.010)
    return Scheduler(lambda key: lane_policy(model, key[1]))


def test_default_lanes_high_small_and_fast_bulk_large_and_patient() -> None:
    model = LanePolicy(max_batch_size=64, max_wait_s=0.050)
    high, normal, bulk = (lane_policy(model, p) for p in ("high", "normal", "bulk"))
    assert (high.max_batch_size, high.max_wait_s) == (8, 0.005)
    assert (normal.max_batch_size, normal.max_wait_s, normal.max_delay_s) == (64, 0.05, 1.0)
    assert (bulk.max_batch_size, bulk.max_wait_s, bulk.max_delay_s) == (64, 0.2, 2.0)
    assert high.rank < normal.rank < bulk.rank
    chosen = BatchingSettings(lanes={"bulk": LaneSettings(max_batch_size=256, max_delay_ms=500)})
    bulk = lane_policy(model, "bulk", chosen)
    assert (bulk.max_batch_size, bulk.max_delay_s) == (256, 0.5)
    # A model-level choice is derived for every lane, as the model's own values are.
    chosen = BatchingSettings(max_batch_size=32, max_wait_ms=20, max_batch_tokens=2048)
    high = lane_policy(model, "high", chosen)
    assert (high.max_batch_size, high.max_wait_s, high.max_batch_tokens) == (4, 0.005, 2048)


def test_the_most_urgent_ready_lane_goes_first() -> None:
    s = three_lanes()
    for i in range(16):
        s.add("m", "bulk", Item("b", i, 1, 0.0))
    s.add("m", "high", Item("h", 0, 1, 0.001))
    assert s.next_batch(0.002) is not None  # bulk is full, high not yet due: bulk runs
    s.add("m", "bulk", Item("b", 99, 1, 0.002))
    batch = s.next_batch(0.006)  # high's 5 ms are up; bulk's one item is not due
    assert batch is not None and batch.key == ("m", "high")


def test_aging_bounds_how_long_bulk_waits_under_an_endless_high_flood() -> None:
    s = three_lanes()  # bulk: starvation bound max(40 x 10 ms, 2 s) = 2 s
    s.add("m", "bulk", Item("b", 0, 1, 0.0))
    now, served_bulk_at, index = 0.0, None, 0
    while served_bulk_at is None and now < 10:
        for _ in range(2):  # high work always ready: 2 items per 1 ms step, N=2 for high
            s.add("m", "high", Item("h", index, 1, now))
            index += 1
        batch = s.next_batch(now)
        if batch is not None and batch.lane == "bulk":
            served_bulk_at = now
        now += 0.001
    assert served_bulk_at is not None and 2.0 <= served_bulk_at <= 2.0 + 0.002


def test_lanes_of_different_models_never_mix_and_keep_their_own_settings() -> None:
    policies = {"a": LanePolicy(2, 0.01), "b": LanePolicy(3, 0.01)}
    s = Scheduler(lambda key: policies[key[0]])
    for i in range(6):
        s.add("a", "normal", Item("x", i, 1, 0.0))
        s.add("b", "normal", Item("x", 100 + i, 1, 0.0))
    sizes = {}
    while (batch := s.next_batch(0.0)) is not None:
        assert {item.index >= 100 for item in batch.items} == {batch.model == "b"}
        sizes.setdefault(batch.model, []).append(len(batch.items))
    assert sizes == {"a": [2, 2, 2], "b": [3, 3]}


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 80), st.sampled_from(["high", "normal", "bulk"]), st.floats(0, 0.02)),
        max_size=80,
    ),
)
def test_composed_policies_place_every_item_once_within_budget_and_bucket(arrivals) -> None:
    model = LanePolicy(max_batch_size=8, max_wait_s=0.010, max_batch_tokens=160, bucket_edges=(8, 16, 32, 64))
    s = Scheduler(lambda key: lane_policy(model, key[1]))
    now, batches = 0.0, []
    for i, (length, priority, gap) in enumerate(arrivals):
        now += gap
        while (batch := s.next_batch(now)) is not None:
            batches.append(batch)
        s.add("m", priority, Item(f"job-{i % 3}", i, length, now))
    while (deadline := s.next_deadline()) is not None:
        now = max(now, deadline)
        while (batch := s.next_batch(now)) is not None:
            batches.append(batch)
    assert sorted(it.index for b in batches for it in b.items) == list(range(len(arrivals)))
    for b in batches:
        policy = lane_policy(model, b.lane)
        assert len(b.items) <= policy.max_batch_size
        assert len(b.items) == 1 or b.padded_tokens <= 160
        # Items wait at most T past the moment a free runner could take them (arrival gaps <= 20 ms).
        assert b.oldest_wait_s <= policy.max_wait_s + 0.02 + 1e-9


def test_a_lane_working_through_its_own_backlog_is_not_starving() -> None:
    s = three_lanes()  # bulk: N=16, starvation bound 2 s
    for i in range(1000):  # a backlog that takes many batches
        s.add("m", "bulk", Item("b", i, 1, 0.0))
    first = s.next_batch(3.0)  # waited 3 s unserved: bulk goes first, as the bound says
    assert first is not None and first.lane == "bulk"
    now, high_waits = 3.1, []
    for step in range(20):  # bulk batches keep running; a high item arrives every other boundary
        if step % 2 == 0:
            s.add("m", "high", Item("h", step, 1, now))
        batch = s.next_batch(now + 0.006)
        assert batch is not None
        if batch.lane == "high":
            high_waits.append(batch.oldest_wait_s)
        now += 0.1
    # Bulk's items are old, but the lane is served at every other boundary: high is never held back.
    assert len(high_waits) == 10 and max(high_waits) < 0.01
