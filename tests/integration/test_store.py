"""ResultStore on SQLite and PostgreSQL: job states and counts, redelivery, results, batch records."""

from __future__ import annotations

import random
import threading
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import numpy as np
import pytest

from worker.store import results as results_module
from worker.store.results import BatchRecord, ItemOutcome, JobSpec, ResultStore, TokenCount


@pytest.fixture
def store(db_url: str) -> Iterator[ResultStore]:
    store = ResultStore.from_url(db_url)
    yield store
    store.close()


def new_job(total: int = 4, model: str = "minilm", priority: str = "normal") -> JobSpec:
    return JobSpec(job_id=str(uuid.uuid4()), model=model, priority=priority, total=total)


def batch(size: int, started_at: datetime | None = None, model: str = "minilm") -> BatchRecord:
    return BatchRecord(
        model=model,
        lane="short",
        size=size,
        real_tokens=10 * size,
        padded_tokens=16 * size,
        wait_ms=12.5,
        run_ms=3.25,
        started_at=started_at or datetime.now(UTC),
        worker="worker-1@host",
    )


def ok(job: JobSpec, index: int) -> ItemOutcome:
    return ItemOutcome(job.job_id, index, f"item-{index}", output={"label": "pos", "score": index / 8})


def err(job: JobSpec, index: int) -> ItemOutcome:
    return ItemOutcome(job.job_id, index, f"item-{index}", error=f"item {index}: input too long")


def write(store: ResultStore, job: JobSpec, outcomes: list[ItemOutcome]) -> int:
    return store.write_batch(batch(len(outcomes)), outcomes, [job])


def test_created_job_is_queued_with_its_total(store: ResultStore) -> None:
    job = new_job(total=7, model="simulated", priority="bulk")
    store.create_job(job)

    status = store.status(job.job_id)
    assert status is not None
    assert (status.state, status.total, status.done, status.failed) == ("queued", 7, 0, 0)
    assert (status.model, status.priority, status.error) == ("simulated", "bulk", None)
    assert status.created_at.tzinfo is not None and status.created_at.utcoffset() == timedelta(0)
    assert status.started_at is None and status.finished_at is None


def test_unknown_job_has_no_status(store: ResultStore) -> None:
    assert store.status(str(uuid.uuid4())) is None
    assert list(store.results(str(uuid.uuid4()))) == []


def test_half_written_job_is_running(store: ResultStore) -> None:
    job = new_job(total=4)
    store.create_job(job)

    assert write(store, job, [ok(job, 0), err(job, 1)]) == 2

    status = store.status(job.job_id)
    assert status is not None
    assert (status.state, status.done, status.failed) == ("running", 1, 1)
    assert status.started_at is not None and status.finished_at is None


def test_redelivered_outcomes_are_stored_and_counted_once(store: ResultStore) -> None:
    job = new_job(total=4)
    store.create_job(job)
    first = [ok(job, 0), err(job, 1)]
    write(store, job, first)

    assert write(store, job, first) == 0
    # A batch mixing a redelivered item with a new one counts only the new one.
    assert write(store, job, [ok(job, 0), ok(job, 2)]) == 1

    status = store.status(job.job_id)
    assert status is not None
    assert (status.state, status.done, status.failed) == ("running", 2, 1)
    assert [outcome.index for outcome in store.results(job.job_id)] == [0, 1, 2]


def test_create_job_again_changes_nothing(store: ResultStore) -> None:
    job = new_job(total=4)
    store.create_job(job)
    write(store, job, [ok(job, 0)])

    store.create_job(JobSpec(job.job_id, "other-model", "high", 99))

    status = store.status(job.job_id)
    assert status is not None
    assert (status.model, status.total, status.state, status.done) == ("minilm", 4, "running", 1)


@pytest.mark.parametrize(
    ("successes", "failures", "state"),
    [(4, 0, "succeeded"), (3, 1, "partial"), (0, 4, "failed")],
)
def test_finished_job_state(store: ResultStore, successes: int, failures: int, state: str) -> None:
    job = new_job(total=4)
    store.create_job(job)
    outcomes = [ok(job, i) for i in range(successes)] + [err(job, successes + i) for i in range(failures)]
    write(store, job, outcomes[:2])
    write(store, job, outcomes[2:])

    status = store.status(job.job_id)
    assert status is not None
    assert (status.state, status.done, status.failed) == (state, successes, failures)
    assert status.started_at is not None and status.finished_at is not None
    assert status.started_at <= status.finished_at


def test_finished_job_never_moves_backwards(store: ResultStore) -> None:
    job = new_job(total=2)
    store.create_job(job)
    write(store, job, [ok(job, 0), ok(job, 1)])
    finished = store.status(job.job_id)

    # An item beyond the total (a producer bug) still may not reopen or re-finish the job.
    assert write(store, job, [err(job, 2)]) == 1

    status = store.status(job.job_id)
    assert finished is not None and status is not None
    assert (status.state, status.finished_at) == ("succeeded", finished.finished_at)
    assert not store.cancel(job.job_id)


def test_cancelled_job_stays_cancelled(store: ResultStore) -> None:
    job = new_job(total=4)
    store.create_job(job)
    write(store, job, [ok(job, 0)])

    assert store.cancel(job.job_id)
    cancelled = store.status(job.job_id)
    write(store, job, [ok(job, 1), ok(job, 2), ok(job, 3)])

    status = store.status(job.job_id)
    assert cancelled is not None and status is not None
    assert (status.state, status.done) == ("cancelled", 4)
    assert status.finished_at == cancelled.finished_at is not None
    assert not store.cancel(job.job_id)
    assert not store.cancel(str(uuid.uuid4()))


def test_failed_job_keeps_its_error(store: ResultStore) -> None:
    job = new_job(total=4)
    store.create_job(job)

    store.fail_job(job.job_id, "could not publish chunk 2 of 3: connection refused")
    write(store, job, [ok(job, 0)])

    status = store.status(job.job_id)
    assert status is not None
    assert (status.state, status.done) == ("failed", 1)
    assert status.error == "could not publish chunk 2 of 3: connection refused"
    assert status.finished_at is not None


def test_results_come_back_ordered_with_outputs_intact(store: ResultStore) -> None:
    job = new_job(total=6)
    store.create_job(job)
    embedding = np.random.default_rng(7).standard_normal(384).astype(np.float32)
    outcomes = [
        ItemOutcome(job.job_id, 0, "a", output=embedding),
        ItemOutcome(
            job.job_id, 1, None, output={"text": "héllo ✓", "tokens": [1, 2, 3], "nested": {"x": None}}
        ),
        ItemOutcome(job.job_id, 2, "c", error="field 'text' must be a string"),
        ItemOutcome(job.job_id, 3, "d", output=np.float32(0.1)),
        ItemOutcome(job.job_id, 4, "e", output="plain string"),
        ItemOutcome(job.job_id, 5, "f", output=[]),
    ]
    shuffled = random.Random(3).sample(outcomes, len(outcomes))
    write(store, job, shuffled[:3])
    write(store, job, shuffled[3:])

    stored = list(store.results(job.job_id))

    assert [outcome.index for outcome in stored] == [0, 1, 2, 3, 4, 5]
    assert [outcome.item_id for outcome in stored] == ["a", None, "c", "d", "e", "f"]
    vector = np.asarray(stored[0].output, dtype=np.float32)
    assert vector.shape == (384,)
    assert np.array_equal(vector.view(np.uint32), embedding.view(np.uint32))
    assert stored[1].output == {"text": "héllo ✓", "tokens": [1, 2, 3], "nested": {"x": None}}
    assert (stored[2].output, stored[2].error) == (None, "field 'text' must be a string")
    assert np.float32(stored[3].output) == np.float32(0.1)
    assert (stored[4].output, stored[5].output) == ("plain string", [])


def test_results_stream_across_pages(store: ResultStore, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(results_module, "RESULTS_PAGE_SIZE", 3)
    job = new_job(total=10)
    write(store, job, [ok(job, i) for i in range(10)])

    assert [outcome.index for outcome in store.results(job.job_id)] == list(range(10))


def test_a_batch_larger_than_the_bound_parameter_limits_is_stored_whole(store: ResultStore) -> None:
    # 10,000 rows x 7 columns is past SQLite's 32,766 and PostgreSQL's 65,535 bound parameters.
    job = new_job(total=10_000)

    assert write(store, job, [ok(job, i) for i in range(10_000)]) == 10_000

    status = store.status(job.job_id)
    assert status is not None
    assert (status.state, status.done) == ("succeeded", 10_000)
    assert sum(1 for _ in store.results(job.job_id)) == 10_000


def test_write_batch_creates_jobs_not_created_before(store: ResultStore) -> None:
    first, second = new_job(total=2, priority="high"), new_job(total=3, model="minilm")
    outcomes = [ok(first, 0), ok(first, 1), err(second, 0)]

    assert store.write_batch(batch(3), outcomes, [first, second]) == 3

    one, two = store.status(first.job_id), store.status(second.job_id)
    assert one is not None and two is not None
    assert (one.state, one.total, one.priority, one.done) == ("succeeded", 2, "high", 2)
    assert (two.state, two.total, two.model, two.failed) == ("running", 3, "minilm", 1)


def test_outcomes_refused_before_batching_are_stored_without_a_batch(store: ResultStore) -> None:
    job = new_job(total=2)

    assert store.write_batch(None, [err(job, 0), err(job, 1)], [job]) == 2

    status = store.status(job.job_id)
    assert status is not None
    assert (status.state, status.failed) == ("failed", 2)
    assert [outcome.error for outcome in store.results(job.job_id)] == [err(job, 0).error, err(job, 1).error]
    assert store.recent_batches() == []


def test_write_batch_refuses_outcomes_without_a_job_spec(store: ResultStore) -> None:
    job = new_job()

    with pytest.raises(ValueError, match=job.job_id):
        store.write_batch(batch(1), [ok(job, 0)], [])

    assert store.status(job.job_id) is None


def test_outcome_needs_exactly_one_of_output_and_error() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        ItemOutcome("job", 0, None)
    with pytest.raises(ValueError, match="exactly one"):
        ItemOutcome("job", 0, None, output=[1.0], error="boom")


def test_batches_are_recorded_newest_first(store: ResultStore) -> None:
    job, other = new_job(total=4), new_job(total=1)
    start = datetime(2025, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)
    older, newer = batch(2, start), batch(2, start + timedelta(seconds=1))
    unrelated = batch(1, start + timedelta(seconds=2), model="simulated")
    store.write_batch(older, [ok(job, 0), ok(job, 1)], [job])
    store.write_batch(newer, [ok(job, 2), ok(job, 3)], [job])
    store.write_batch(unrelated, [ok(other, 0)], [other])

    assert store.recent_batches() == [unrelated, newer, older]
    assert store.recent_batches(job.job_id) == [newer, older]
    assert store.recent_batches(job.job_id, limit=1) == [newer]
    assert store.recent_batches()[0].started_at.tzinfo is not None


def test_concurrent_redelivery_counts_each_item_once(store: ResultStore) -> None:
    # Four workers write the same 200 items in different orders: as if every message were redelivered.
    job = new_job(total=200)
    store.create_job(job)
    outcomes = [ok(job, i) if i % 10 else err(job, i) for i in range(200)]
    inserted: list[int] = []

    def worker(seed: int) -> None:
        mine = random.Random(seed).sample(outcomes, len(outcomes))
        for start in range(0, len(mine), 20):
            inserted.append(store.write_batch(batch(20), mine[start : start + 20], [job]))

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    status = store.status(job.job_id)
    assert status is not None
    assert sum(inserted) == 200
    assert (status.state, status.done, status.failed) == ("partial", 180, 20)
    assert len(list(store.results(job.job_id))) == 200


def generated(job: JobSpec, index: int, tokens: int) -> ItemOutcome:
    output = {"text": "x" * tokens, "tokens": tokens, "finish_reason": "length"}
    return ItemOutcome(job.job_id, index, None, output=output, tokens=tokens)


def test_a_job_that_generates_nothing_has_no_token_count(store: ResultStore) -> None:
    job = new_job(total=2)
    write(store, job, [ok(job, 0)])

    status = store.status(job.job_id)
    assert status is not None
    assert (status.generated_tokens, status.running_tokens) == (None, None)


def test_generated_tokens_count_running_and_stored_items(store: ResultStore) -> None:
    job = new_job(total=3, model="gpt2")
    store.create_job(job)
    store.record_tokens([TokenCount(job.job_id, 0, 5), TokenCount(job.job_id, 1, 2)])
    store.record_tokens([TokenCount(job.job_id, 0, 9)])  # a later report replaces the earlier one
    assert _tokens(store, job) == (11, 11)

    write(store, job, [generated(job, 0, 12)])
    assert _tokens(store, job) == (14, 2)

    # The item's run reports after its result (a late or a redelivered run): the stored count stays.
    store.record_tokens([TokenCount(job.job_id, 0, 3)])
    write(store, job, [generated(job, 0, 40)])
    assert _tokens(store, job) == (14, 2)


def test_a_finished_job_counts_only_its_stored_tokens(store: ResultStore) -> None:
    job = new_job(total=2, model="gpt2")
    store.record_tokens([TokenCount(job.job_id, 1, 7)])  # a run that crashed before storing item 1
    write(store, job, [generated(job, 0, 4), err(job, 1)])

    status = store.status(job.job_id)
    assert status is not None and status.state == "partial"
    assert (status.generated_tokens, status.running_tokens) == (4, 0)


def _tokens(store: ResultStore, job: JobSpec) -> tuple[int | None, int | None]:
    status = store.status(job.job_id)
    assert status is not None
    return status.generated_tokens, status.running_tokens
