"""The pure scheduler under a fake clock: N and T flushes, fairness across jobs, ordering."""

from __future__ import annotations

from unittest.mock import patch

from hypothesis import given, settings
from hypothesis import strategies as st

from worker.batching.buckets import Bucket
from worker.batching.policy import LanePolicy
from worker.batching.scheduler import Item, Scheduler

POLICIES = {
    ("m", "high"): LanePolicy(max_batch_size=2, max_wait_s=0.005, rank=0),
    ("m", "normal"): LanePolicy(max_batch_size=4, max_wait_s=0.050, rank=1),
    ("other", "normal"): LanePolicy(max_batch_size=3, max_wait_s=0.050, rank=1),
}


def scheduler() -> Scheduler:
    return Scheduler(POLICIES.__getitem__)


def item(job: str, index: int, at: float, length: int = 1) -> Item:
    return Item(job_id=job, index=index, length=length, arrived=at)


def test_flushes_at_n_items_before_the_deadline() -> None:
    s = scheduler()
    for i in range(3):
        s.add("m", "normal", item("a", i, at=0.0))
    assert s.next_batch(now=0.001) is None
    s.add("m", "normal", item("a", 3, at=0.001))
    batch = s.next_batch(now=0.001)
    assert batch is not None
    assert [it.index for it in batch.items] == [0, 1, 2, 3]
    assert len(s) == 0


def test_flushes_a_partial_batch_when_the_oldest_item_waited_t() -> None:
    s = scheduler()
    s.add("m", "normal", item("a", 0, at=1.0))
    s.add("m", "normal", item("a", 1, at=1.04))
    assert s.next_deadline() == 1.05
    assert s.next_batch(now=1.0499) is None
    batch = s.next_batch(now=1.05)
    assert batch is not None and [it.index for it in batch.items] == [0, 1]
    assert batch.oldest_wait_s == 1.05 - 1.0


def test_never_more_than_n_items_and_the_rest_waits() -> None:
    s = scheduler()
    for i in range(10):
        s.add("m", "normal", item("a", i, at=0.0))
    sizes = []
    while (batch := s.next_batch(now=0.0)) is not None:
        sizes.append(len(batch.items))
    assert sizes == [4, 4]  # the last 2 are not ready until T
    assert len(s) == 2
    batch = s.next_batch(now=0.05)
    assert batch is not None and len(batch.items) == 2


def test_items_of_one_job_run_in_order() -> None:
    s = scheduler()
    for i in range(9):
        s.add("m", "normal", item("a", i, at=i / 1000))
    seen = []
    while (batch := s.next_batch(now=1.0)) is not None:
        seen += [it.index for it in batch.items]
    assert seen == list(range(9))


def test_a_small_job_shares_the_next_batch_with_a_big_one() -> None:
    s = scheduler()
    for i in range(100):
        s.add("m", "normal", item("big", i, at=0.0))
    s.add("m", "normal", item("small", 0, at=0.001))
    batch = s.next_batch(now=0.001)
    assert batch is not None
    assert [it.job_id for it in batch.items].count("small") == 1


def test_jobs_take_turns_when_there_are_more_jobs_than_slots() -> None:
    s = scheduler()
    for job in "abcdef":
        for i in range(2):
            s.add("m", "normal", item(job, i, at=0.0))
    first = s.next_batch(now=0.0)
    second = s.next_batch(now=0.0)
    assert first is not None and second is not None
    assert [it.job_id for it in first.items] == ["a", "b", "c", "d"]
    # e and f, which the first batch could not reach, go first now.
    assert [it.job_id for it in second.items][:2] == ["e", "f"]


def test_a_batch_never_mixes_models_and_the_urgent_lane_goes_first() -> None:
    s = scheduler()
    for i in range(4):
        s.add("m", "normal", item("bulkish", i, at=0.0))
    for i in range(3):
        s.add("other", "normal", item("o", i, at=0.0))
    s.add("m", "high", item("h", 0, at=0.0))
    s.add("m", "high", item("h", 1, at=0.0))
    lanes = []
    while (batch := s.next_batch(now=0.0)) is not None:
        assert len({it.job_id for it in batch.items}) == 1
        lanes.append(batch.key)
    assert lanes == [("m", "high"), ("m", "normal"), ("other", "normal")]


def test_token_counts_of_a_batch() -> None:
    s = scheduler()
    for i, length in enumerate([3, 7, 5, 1]):
        s.add("m", "normal", item("a", i, at=0.0, length=length))
    batch = s.next_batch(now=0.0)
    assert batch is not None
    assert (batch.real_tokens, batch.padded_tokens) == (16, 28)


arrivals = st.lists(
    st.tuples(
        st.sampled_from(["m", "other"]),
        st.sampled_from(["high", "normal"]),
        st.sampled_from(["j1", "j2", "j3"]),
        st.floats(min_value=0, max_value=0.01),  # gap since the previous arrival
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(arrivals)
def test_every_item_lands_in_exactly_one_batch_and_deadlines_hold(events) -> None:
    policies = dict(POLICIES)
    policies[("other", "high")] = LanePolicy(max_batch_size=2, max_wait_s=0.005, rank=0)
    s = Scheduler(policies.__getitem__)
    now, batches, counters = 0.0, [], {}
    for model, priority, job, gap in events:
        now += gap
        # The runner polls whenever it is free: drain everything due before this arrival.
        while (batch := s.next_batch(now)) is not None:
            batches.append(batch)
        index = counters[job] = counters.get(job, -1) + 1
        s.add(model, priority, Item(job, index, 1, now, ref=(model, priority)))
    while (deadline := s.next_deadline()) is not None:
        now = max(now, deadline)
        while (batch := s.next_batch(now)) is not None:
            batches.append(batch)
    taken = [(it.job_id, it.index) for b in batches for it in b.items]
    assert sorted(taken) == sorted((job, i) for job, last in counters.items() for i in range(last + 1))
    for b in batches:
        assert all(it.ref == b.key for it in b.items)  # no mixing of models or priorities
        assert len(b.items) <= policies[b.key].max_batch_size
        # A free runner takes a batch no later than its oldest item's deadline.
        assert b.oldest_wait_s <= policies[b.key].max_wait_s + 0.01 + 1e-9


messages = st.lists(
    st.tuples(
        st.sampled_from(["j1", "j2", "j3"]),
        st.lists(st.integers(min_value=1, max_value=40), min_size=1, max_size=12),  # item lengths
        st.floats(min_value=0, max_value=0.02),  # gap since the previous message
        st.integers(min_value=0, max_value=3),  # batches the runner takes before the next message
    ),
    max_size=25,
)


def _replay(events, policy, *, by_run: bool) -> list[tuple[float, list[tuple[str, int]]]]:
    """The batches (time taken, items) of the messages in ``events``, added by add_run or item by item."""
    s, now, counters, out = Scheduler(policy), 0.0, {}, []
    for job, lengths, gap, takes in events:
        now += gap
        start = counters.get(job, 0)
        counters[job] = start + len(lengths)
        run = [Item(job, start + k, length, now) for k, length in enumerate(lengths)]
        if by_run:
            s.add_run("m", "normal", run)
        else:
            for it in run:
                s.add("m", "normal", it)
        for _ in range(takes):
            if (batch := s.next_batch(now)) is not None:
                out.append((now, [(it.job_id, it.index) for it in batch.items]))
    while (deadline := s.next_deadline()) is not None:
        now = max(now, deadline)
        while (batch := s.next_batch(now)) is not None:
            out.append((now, [(it.job_id, it.index) for it in batch.items]))
    assert len(s) == 0
    return out


@settings(max_examples=200, deadline=None)
@given(messages, st.sampled_from([None, 60, 150]), st.sampled_from([(), (8, 20)]))
def test_a_message_added_as_one_run_batches_exactly_as_its_items_added_one_by_one(
    events, budget, edges
) -> None:
    # The prepare thread adds a message's items with add_run; the batches must be the very ones add() of each
    # item in turn gives: same items, same order, same times, under N, token budgets and buckets. And a
    # bucket holding one job takes its items as one run: what taking them in turns (as among many jobs)
    # would take.
    def policy(key):
        return LanePolicy(max_batch_size=5, max_wait_s=0.01, max_batch_tokens=budget, bucket_edges=edges)

    by_run = _replay(events, policy, by_run=True)
    assert by_run == _replay(events, policy, by_run=False)
    with patch.object(Bucket, "_take_run", Bucket._take_turns):
        assert by_run == _replay(events, policy, by_run=True)
