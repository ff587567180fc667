"""Hostile callers and raw messages against a real worker on Redis and PostgreSQL.

Raw ``batchwork.infer`` messages with arbitrary arguments, interleaved with ordinary jobs: every ordinary job
succeeds, every message's items end (stored, or its job failed with a reason), no other job is touched, and
the worker keeps making progress. Bad producer calls raise InvalidInput naming the argument and leave nothing
behind.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
import redis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from sqlalchemy import func, select

from tests.integration.processes import TEST_MODELS, service_env, workers
from worker.calls import TASK_NAME
from worker.celery_app import create_app
from worker.celery_compat import task_message
from worker.client import Client
from worker.errors import InvalidInput
from worker.settings import Settings
from worker.store import tables
from worker.store.results import ResultStore
from worker.store.values import FINISHED_STATES

ECHO = "tests.support.models:Echo"
QUEUES = ("batchwork.high", "batchwork.normal", "batchwork.bulk")

weird = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.text(min_size=201, max_size=400),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)
item = st.one_of(
    weird,
    st.text(min_size=1, max_size=30),
    st.fixed_dictionaries(
        {"text": st.one_of(weird, st.text(min_size=1, max_size=30))}, optional={"id": weird}
    ),
)
message_kwargs = st.fixed_dictionaries(
    {},
    optional={
        "model": st.one_of(
            weird, st.sampled_from(["noop", ECHO, "this:Zen", "antigravity:Fly", "simulated"])
        ),
        "inputs": st.one_of(weird, st.lists(item, max_size=4)),
        "priority": st.one_of(weird, st.sampled_from(["high", "normal", "bulk"])),
        "job_id": st.one_of(weird, st.uuids().map(str)),
        "offset": st.one_of(weird, st.integers(min_value=0, max_value=6)),
        "total": st.one_of(weird, st.integers(min_value=0, max_value=8)),
        "expires_at": weird,
        "created_at": weird,
        "surprise": weird,
    },
)


@pytest.fixture
def stack(
    redis_url: str, pg_url: str, pg_store: ResultStore
) -> Iterator[tuple[Any, ResultStore, redis.Redis]]:
    env = service_env(redis_url, pg_url, batching={ECHO: {"max_batch_size": 8, "max_wait_ms": 5}})
    app = create_app(Settings(broker_url=redis_url, database_url=pg_url, models=TEST_MODELS))
    client = redis.Redis.from_url(redis_url)
    with workers(env) as [worker]:
        yield app, pg_store, client
    assert "The Zen of Python" not in "\n".join(worker.log)  # no message made the worker import a module
    client.close()


def wait_idle(client: redis.Redis, timeout_s: float = 60) -> None:
    """Until every queue is empty and the worker holds nothing: all sent messages are settled."""
    deadline = time.monotonic() + timeout_s
    while sum(client.llen(q) for q in QUEUES) or client.hlen("batchwork.unacked"):
        assert time.monotonic() < deadline, "the worker stopped making progress"
        time.sleep(0.05)


@pytest.mark.slow
def test_raw_messages_cannot_stop_a_worker_or_touch_another_job(stack: Any) -> None:
    app, store, broker = stack

    ordinary_id = app.send_task("batchwork.infer", kwargs={"model": ECHO, "inputs": ["ordinary"]}).id
    wait_idle(broker)
    ordinary = store.status(ordinary_id)
    assert ordinary is not None and ordinary.state == "succeeded"

    # No shrinking: each failing try waits a minute for the worker, so shrinking could take CI's whole budget.
    @settings(
        max_examples=40,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        phases=(Phase.explicit, Phase.reuse, Phase.generate),
    )
    @given(st.lists(st.tuples(message_kwargs, st.booleans(), st.booleans()), min_size=1, max_size=4))
    def check(messages: list[tuple[dict[str, Any], bool, bool]]) -> None:
        sent = []
        for kwargs, positional, aim_at_ordinary in messages:
            if aim_at_ordinary:
                kwargs = {**kwargs, "job_id": ordinary_id}
            task_id = str(uuid.uuid4())
            app.send_task("batchwork.infer", args=[1] if positional else None, kwargs=kwargs, task_id=task_id)
            sent.append((task_id, kwargs))
        fine = app.send_task("batchwork.infer", kwargs={"model": ECHO, "inputs": ["still fine"]}).id
        wait_idle(broker)
        assert_fine(store, fine)
        assert store.status(ordinary_id) == ordinary  # nothing any message did reached it
        for task_id, kwargs in sent:
            assert_ended(store, task_id, kwargs, ordinary_id)

    check()


@pytest.mark.slow
def test_messages_of_no_batchwork_task_are_refused_and_the_worker_goes_on(stack: Any) -> None:
    """Only batchwork.infer messages reach the engine; another task's, or one with no task header at all,
    is refused by Celery's own handling (dropped, not left held) while batchwork's next job is served."""
    app, store, broker = stack
    app.send_task("someone.else", kwargs={"inputs": ["not ours"]})
    envelope = orjson.loads(
        task_message(TASK_NAME, str(uuid.uuid4()), QUEUES[1], b"{}", kwargsrepr="{}", origin="hostile")
    )
    broker.lpush(QUEUES[1], orjson.dumps({**envelope, "headers": {}}))
    broker.lpush(QUEUES[1], orjson.dumps({**envelope, "headers": None}))
    fine = app.send_task("batchwork.infer", kwargs={"model": ECHO, "inputs": ["still fine"]}).id
    wait_idle(broker)
    assert_fine(store, fine)


@pytest.mark.slow
def test_a_message_kombu_cannot_decode_is_dropped_and_the_rest_of_its_fetch_is_served(stack: Any) -> None:
    _app, store, broker = stack

    def good() -> tuple[str, bytes]:
        task_id, kwargs = str(uuid.uuid4()), orjson.dumps({"model": ECHO, "inputs": ["still fine"]})
        return task_id, task_message(TASK_NAME, task_id, QUEUES[1], kwargs, kwargsrepr="{}", origin="hostile")

    goods = [good() for _ in range(3)]
    envelope = orjson.loads(goods[0][1])
    envelope["headers"]["id"] = str(uuid.uuid4())
    bad = [
        {**envelope, "body": "not base64"},
        {**envelope, "body": 12345},
        {**envelope, "properties": {**envelope["properties"], "body_encoding": "rot13"}},
    ]
    # One LPUSH: the worker takes them in one fetch, the bad ones between the good ones.
    broker.lpush(QUEUES[1], goods[0][1], *map(orjson.dumps, bad), goods[1][1], goods[2][1])
    wait_idle(broker)  # nothing held: the bad ones were dropped, not handed back after every lease
    for task_id, _ in goods:
        assert_fine(store, task_id)


def assert_fine(store: ResultStore, job_id: str) -> None:
    status = store.status(job_id)
    assert status is not None and status.state == "succeeded", status
    assert [r.output for r in store.results(job_id)] == [{"echo": "still fine", "n": 10}]


def assert_ended(store: ResultStore, task_id: str, kwargs: dict[str, Any], ordinary_id: str) -> None:
    """A message's job failed with a reason, or every item it carried has a stored outcome."""
    named = kwargs.get("job_id")
    if named == ordinary_id:
        return  # checked by the caller: the ordinary job is unchanged
    job_id = named if isinstance(named, str) and _is_uuid(named) else task_id
    status = store.status(job_id)
    if status is None:  # refused, and its named job id is no job id: then the task id holds the failure
        status = store.status(task_id)
    assert status is not None, f"no trace of message {task_id} ({kwargs!r})"
    if status.state == "failed" and status.error:
        return
    stored = {r.index for r in store.results(status.job_id)}
    carried = range(kwargs.get("offset", 0), kwargs.get("offset", 0) + len(kwargs["inputs"]))
    assert set(carried) <= stored, (status, kwargs)
    if len(carried) == status.total:
        assert status.state in FINISHED_STATES


def _is_uuid(text: str) -> bool:
    try:
        return str(uuid.UUID(text)) == text
    except ValueError:
        return False


call_kwargs = st.fixed_dictionaries(
    {},
    optional={
        "model": st.one_of(weird, st.sampled_from(["noop", "this:Zen"])),
        "inputs": st.one_of(weird, st.lists(item, max_size=3)),
        "priority": weird,
        "deadline_s": weird,
        "job_id": weird,
        "offset": weird,
    },
)


@pytest.mark.slow
def test_bad_producer_calls_raise_naming_the_argument_and_leave_nothing(
    producer: dict[str, str], redis_url: str, pg_store: ResultStore
) -> None:
    from worker.settings import get_settings
    from worker.tasks import infer

    broker = redis.Redis.from_url(redis_url)
    client = Client(get_settings())

    def left_behind() -> tuple[int, int, int]:
        with pg_store.engine.connect() as conn:
            jobs = conn.scalar(select(func.count()).select_from(tables.jobs)) or 0
        return sum(broker.llen(q) for q in QUEUES), len(broker.keys("batchwork.job:*")), jobs

    @settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
    @given(call_kwargs, st.booleans())
    def check(kwargs: dict[str, Any], via_delay: bool) -> None:
        before = left_behind()
        try:
            if via_delay:
                infer.delay(**kwargs)
            else:
                client.submit(kwargs.get("model"), kwargs.get("inputs"), kwargs.get("priority"))  # type: ignore[arg-type]
        except InvalidInput as exc:
            assert len(str(exc)) < 400, str(exc)
            assert any(word in str(exc) for word in ("argument", "item", "model", "give")), str(exc)
            assert left_behind() == before
        else:
            assert left_behind() != before  # accepted: the job is somewhere

    try:
        check()
    finally:
        broker.close()
