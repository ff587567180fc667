"""Celery's own result API over the batchwork store, and the Celery options infer refuses."""

from __future__ import annotations

from typing import Any

import pytest
from celery import states

from tests.integration.processes import workers
from worker.errors import InvalidInput, JobFailed
from worker.store.results import ResultStore

POISON = "tests.support.models:Poison"


@pytest.mark.slow
def test_state_ready_and_get_read_the_store(producer: dict[str, str], pg_store: ResultStore) -> None:
    from worker.tasks import infer

    with workers(producer):
        slow = infer.delay(model="simulated", inputs=["abc", "de"])
        assert slow.state in (states.PENDING, states.STARTED) and not slow.ready()
        assert slow.get(timeout=30) == [3, 2]
        assert slow.state == states.SUCCESS and slow.ready() and slow.successful()

        broken = infer.delay(model=POISON, inputs=["fine", "poison", "also fine"])
        with pytest.raises(JobFailed) as caught:
            broken.get(timeout=30)
        assert broken.state == states.FAILURE and broken.failed()
        message = str(caught.value)
        assert "1 of 3 items failed (items 1)" in message and "cannot digest 'poison'" in message
        assert caught.value.outputs == [4, None, 9] and list(caught.value.errors) == [1]
        assert isinstance(broken.get(timeout=5, propagate=False), JobFailed)


def test_revoke_cancels_the_job(producer: dict[str, str], pg_store: ResultStore) -> None:
    from worker.tasks import infer

    waiting = infer.delay(model="simulated", inputs=["abc", "de"])  # no worker: it waits in the queue
    waiting.revoke()
    assert waiting.state == states.REVOKED
    status = pg_store.status(waiting.id)
    assert status is not None and status.state == "cancelled"
    infer.AsyncResult("00000000-0000-4000-8000-000000000000").revoke()  # no such job: nothing to stop


def test_an_unknown_id_is_pending_as_in_celery(producer: dict[str, str]) -> None:
    from worker.tasks import infer

    assert infer.AsyncResult("00000000-0000-0000-0000-000000000000").state == states.PENDING
    assert infer.AsyncResult("not even an id").state == states.PENDING


@pytest.mark.parametrize(
    ("options", "fragment"),
    [
        ({"countdown": 10}, "countdown: items start as soon as a batch forms"),
        ({"eta": "2030-01-01T00:00:00"}, "eta: items start as soon as a batch forms"),
        ({"link": "sig"}, "link: a job has many items"),
        ({"priority": 9}, "priority: pass priority='high'"),
        ({"queue": "other"}, "queue: the queue follows the call's priority argument"),
        ({"task_id": "00000000-0000-0000-0000-000000000001"}, "task_id: batchwork chooses the job id"),
        ({"shadow": "x"}, "shadow: not supported by batchwork"),
    ],
)
def test_options_batchwork_does_not_honour_are_refused(
    producer: dict[str, str], options: dict[str, Any], fragment: str
) -> None:
    from worker.tasks import infer

    with pytest.raises(InvalidInput, match=fragment.replace("(", r"\(")):
        infer.apply_async(kwargs={"model": "noop", "inputs": ["a"]}, **options)


def test_job_id_is_not_an_argument_a_caller_may_give(producer: dict[str, str], pg_store: ResultStore) -> None:
    from worker.tasks import infer

    existing = infer.delay(model="noop", inputs=["a"]).id
    with pytest.raises(InvalidInput, match="unknown argument"):
        infer.delay(model="noop", inputs=["b"], job_id=existing)


@pytest.mark.slow
def test_celery_expires_is_honoured_as_a_deadline(producer: dict[str, str], pg_store: ResultStore) -> None:
    from worker.tasks import infer

    late = infer.apply_async(kwargs={"model": "noop", "inputs": ["a", "b"]}, expires=0.001)
    with workers(producer), pytest.raises(JobFailed, match="expired"):
        late.get(timeout=30)
    with pytest.raises(InvalidInput, match="not both"):
        infer.apply_async(kwargs={"model": "noop", "inputs": ["a"], "deadline_s": 5}, expires=5)
