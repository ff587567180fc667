"""ResultStore on SQLite and PostgreSQL: job states and counts, redelivery, cancel and failure."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest

from tests.integration.stored import err, new_job, ok, write
from worker.store.results import JobSpec, ResultStore


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
    # What a worker produced after the cancel committed is stored as cancelled, not as an output.
    assert (status.state, status.done, status.failed) == ("cancelled", 1, 3)
    assert [(r.index, r.error) for r in store.results(job.job_id)] == [
        (0, None),
        (1, "cancelled"),
        (2, "cancelled"),
        (3, "cancelled"),
    ]
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
