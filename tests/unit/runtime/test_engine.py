"""The whole engine of one worker (prepare, run, store and watch threads) without Celery, Redis or SQL: fake
messages in, the in-memory store (tests/support/memory_store.py) and a fake clock, models of the tests' own.
What a user cares about: each item ends with exactly one stored outcome, errors stay with their item, a
cancelled job's items never run, and every message is acknowledged once, only after its items are stored.
"""

from __future__ import annotations

import gc
import math
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import orjson
import pytest
import redis
from kombu.exceptions import ContentDisallowed

from tests.support.memory_store import MemoryStore, MemoryTunedLimits
from worker.broker.keys import Keys
from worker.calls import InferMessage
from worker.models.base import Model
from worker.runtime import prepare_thread
from worker.runtime.deliveries import Delivery, Pack
from worker.runtime.engine import Engine
from worker.runtime.hooks import Admission, Hook, Hooks, Run
from worker.runtime.hooks.journal import Journal
from worker.runtime.outbox import Outbox
from worker.settings import BatchingSettings, Settings
from worker.store.values import ItemRecord, JobSpec

ECHO = "tests.support.models:Echo"
POISON = "tests.support.models:Poison"
RECORDER = "tests.unit.runtime.test_engine:Recorder"
STEP_FAILS = "tests.support.models:StepFails"
EXITS = "tests.support.models:Exits"
STEP_FAILS_NO_ABORT = "tests.support.models:StepFailsNoAbort"


class Recorder(Model):
    """Returns each text upper-cased and remembers every payload it ran."""

    name = "recorder"
    max_batch_size = 8
    max_wait_ms = 10.0
    ran: list[str] = []  # noqa: RUF012  (the test reads what every instance ran)

    def forward(self, payloads: Sequence[str]) -> list[str]:
        Recorder.ran += payloads
        return [text.upper() for text in payloads]


class FakeClock:
    """The engine's clock (arrivals, waits, deadlines of lanes): moves only when a test moves it."""

    def __init__(self) -> None:
        self.now = 1000.0
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self.now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self.now += seconds


class FakeMessage:
    """A kombu message as the engine reads it: a JSON body of (args, kwargs, embed), its headers, and an
    ack the outbox calls when no channel acknowledges in bulk (the embedded run's path)."""

    content_type = "application/json"
    content_encoding = "utf-8"

    def __init__(self, kwargs: dict[str, Any], task_id: str | None = None) -> None:
        self.headers = {"id": task_id or str(uuid.uuid4())}
        self.properties: dict[str, Any] = {}
        self.delivery_tag = self.headers["id"]
        self.body = orjson.dumps([[], kwargs, {}])
        self.acks = 0

    def decode(self) -> Any:
        return orjson.loads(self.body)

    def ack_log_error(self, logger: Any, errors: Any) -> None:
        self.acks += 1


def message(model: str, inputs: list[Any], job_id: str | None = None, **fields: Any) -> FakeMessage:
    call = InferMessage(job_id or str(uuid.uuid4()), model, inputs, total=len(inputs), **fields)
    return FakeMessage(call.kwargs(), task_id=call.job_id)


def job_of(sent: FakeMessage) -> str:
    return str(sent.decode()[1]["job_id"])


def wait_until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


class Running:
    """An engine on its threads, its store, tuned limits and clock."""

    def __init__(
        self,
        settings: Settings,
        tuned: dict[str, dict[str, Any]] | None = None,
        journal: Journal | None = None,
    ) -> None:
        self.store = MemoryStore()
        self.tuned = MemoryTunedLimits(tuned)
        self.clock = FakeClock()
        self.engine = Engine(
            settings,
            self.store,
            Outbox(),
            tuned_limits=self.tuned,
            worker_name="w@test",
            journal=journal,
            clock=self.clock,
        )

    def send(self, *sent: FakeMessage) -> None:
        for each in sent:
            self.engine.accept(each)

    def stored(self, job_id: str, count: int, *, advance_s: float = 1.0) -> list[ItemRecord]:
        """The job's outcomes once ``count`` are stored, the clock moved past every lane's wait as it goes
        (items that arrive later wait from their own arrival)."""

        def enough() -> bool:
            if len(self.store.results(job_id)) >= count:
                return True
            self.clock.advance(advance_s)
            return False

        wait_until(enough)
        return self.store.results(job_id)


@pytest.fixture
def start() -> Iterator[Callable[..., Running]]:
    started: list[Running] = []
    threshold = gc.get_threshold()

    def start(settings: Settings | None = None, **kwargs: Any) -> Running:
        running = Running(settings or Settings(models=["noop", ECHO, POISON, RECORDER]), **kwargs)
        running.engine.start()
        started.append(running)
        return running

    Recorder.ran = []
    yield start
    for running in started:
        running.engine.stop(timeout_s=10)
    gc.unfreeze()  # Engine.start tunes the collector for a worker process; give the test process its own
    gc.set_threshold(*threshold)


def test_an_item_goes_in_and_one_result_comes_out(start: Callable[..., Running]) -> None:
    running = start()
    sent = message("noop", ["hello"])
    running.send(sent)
    job_id = job_of(sent)
    assert running.stored(job_id, 1) == [ItemRecord(job_id, 0, None, output=0)]
    wait_until(lambda: sent.acks == 1)
    job = running.store.jobs[job_id]
    assert (job.state, job.done, job.failed) == ("succeeded", 1, 0)
    assert [(b.model, b.lane, b.size) for b in running.store.batches] == [("noop", "normal", 1)]
    time.sleep(0.05)
    assert sent.acks == 1 and len(running.store.outcomes) == 1  # exactly once


def test_a_lane_waits_for_its_wait_on_the_engines_clock(start: Callable[..., Running]) -> None:
    running = start()
    sent = message(ECHO, ["a", "bb"])
    running.send(sent)
    job_id = job_of(sent)
    wait_until(lambda: job_id in running.engine.holdings.jobs())
    time.sleep(0.2)  # Echo waits 10 ms for more items, on the fake clock, which has not moved
    assert running.store.results(job_id) == [] and sent.acks == 0
    outcomes = running.stored(job_id, 2, advance_s=0.011)
    assert [o.output for o in outcomes] == [{"echo": "a", "n": 1}, {"echo": "bb", "n": 2}]
    wait_until(lambda: sent.acks == 1)


def test_a_failing_item_is_stored_as_its_error_and_the_rest_succeed(start: Callable[..., Running]) -> None:
    running = start()
    sent = message(POISON, ["a", "poison", "ccc", "dd"])
    running.send(sent)
    job_id = job_of(sent)
    outcomes = running.stored(job_id, 4)
    assert [o.output for o in outcomes] == [1, None, 3, 2]
    assert outcomes[1].error is not None and "cannot digest 'poison'" in outcomes[1].error
    wait_until(lambda: sent.acks == 1)
    job = running.store.jobs[job_id]
    assert (job.state, job.done, job.failed) == ("partial", 3, 1)


def test_an_invalid_item_fails_alone_before_any_batch(start: Callable[..., Running]) -> None:
    running = start()
    sent = message(ECHO, ["fine", {"text": 7}])
    running.send(sent)
    job_id = job_of(sent)
    ok, bad = running.stored(job_id, 2)
    assert ok.output == {"echo": "fine", "n": 4}
    assert bad.error is not None and bad.error.startswith("invalid input:")
    wait_until(lambda: sent.acks == 1)


def test_a_cancelled_jobs_items_are_not_run(start: Callable[..., Running]) -> None:
    running = start()
    job_id = str(uuid.uuid4())
    running.store.create_job(JobSpec(job_id, RECORDER, "normal", 3))
    running.store.cancel(job_id)
    sent = message(RECORDER, ["x", "y", "z"], job_id=job_id)
    other = message(RECORDER, ["kept"])
    running.send(sent, other)
    wait_until(lambda: job_id in running.engine.holdings.jobs())
    running.engine.cancels.refresh()  # the watch thread's once-a-second question, asked now
    outcomes = running.stored(job_id, 3)
    assert [(o.output, o.error) for o in outcomes] == [(None, "cancelled")] * 3
    assert [o.output for o in running.stored(job_of(other), 1)] == ["KEPT"]
    assert Recorder.ran == ["kept"]  # the cancelled job's items never reached the model
    assert running.store.jobs[job_id].state == "cancelled"
    wait_until(lambda: sent.acks == 1 and other.acks == 1)


def test_a_message_that_is_no_call_fails_its_own_job_and_is_acknowledged(
    start: Callable[..., Running],
) -> None:
    running = start()
    job_id = str(uuid.uuid4())
    sent = FakeMessage({"model": "no-such-model", "inputs": ["a"], "job_id": job_id})
    running.send(sent)
    wait_until(lambda: sent.acks == 1)
    job = running.store.jobs[job_id]
    assert job.state == "failed" and job.error is not None and "no-such-model" in job.error
    assert running.store.outcomes == {}


class PickledMessage(FakeMessage):
    """A body in a content type the worker does not accept: kombu refuses to decode it (never unpickles)."""

    content_type = "application/x-python-serialize"

    def decode(self) -> Any:
        raise ContentDisallowed("Refusing to deserialize untrusted content of type pickle")


def test_a_message_in_a_content_type_not_accepted_fails_its_own_job_saying_so(
    start: Callable[..., Running],
) -> None:
    running = start()
    sent = PickledMessage({}, task_id=str(uuid.uuid4()))
    running.send(sent)
    wait_until(lambda: sent.acks == 1)
    job = running.store.jobs[sent.headers["id"]]
    assert (job.state, job.error) == (
        "failed",
        "invalid message: its body cannot be read: ContentDisallowed: Refusing to deserialize untrusted "
        "content of type pickle",
    )


def test_explicit_settings_go_over_tuned_limits_in_the_worker(start: Callable[..., Running]) -> None:
    """The worker's lanes resolve N as `batchwork models` does: explicit, then tuned, then the model's."""
    tuned = {"tests.support.models:Echo": {"max_batch_size": 2}}
    running = start(tuned=tuned)
    sent = message(ECHO, ["a", "b", "c", "d", "e"])
    running.send(sent)
    wait_until(lambda: len(running.store.batches) == 2)  # full batches go at once, whatever the clock
    running.stored(job_of(sent), 5)
    assert [b.size for b in running.store.batches] == [2, 2, 1]

    settings = Settings(models=["noop", ECHO], batching={ECHO: BatchingSettings(max_batch_size=3)})
    running = start(settings, tuned=tuned)
    sent = message(ECHO, ["a", "b", "c", "d", "e"])
    running.send(sent)
    running.stored(job_of(sent), 5)
    assert [b.size for b in running.store.batches] == [3, 2]


class DownJournal(Journal):
    """The journal while Redis is down: every call fails as redis-py's does."""

    def __init__(self) -> None:
        super().__init__(redis.Redis(), Keys("test"))  # never connects: every call below fails first

    def deaths(self, job_id: str, indices: Sequence[int]) -> list[int]:
        raise redis.ConnectionError("Error 111 connecting to localhost:6379. Connection refused.")

    def _add(self, items: Sequence[tuple[str, int]], amount: int) -> None:
        self.deaths("", [])

    def stored(self, items: Sequence[tuple[str, int]]) -> None:
        self.deaths("", [])


def test_a_redelivered_message_still_ends_when_its_death_counts_cannot_be_read(
    start: Callable[..., Running],
) -> None:
    # Its worker died, so its items are suspects; with the counts unreadable each runs alone, as if it had
    # died before, and the message is settled and acknowledged (it used to stay held, never settled).
    running = start(journal=DownJournal())
    sent = message(RECORDER, ["a", "b", "c"])
    sent.properties["batchwork_lost"] = 1
    running.send(sent)
    outcomes = running.stored(job_of(sent), 3)
    assert [(o.output, o.error) for o in outcomes] == [("A", None), ("B", None), ("C", None)]
    assert [(b.lane, b.size) for b in running.store.batches] == [("isolated", 1)] * 3
    wait_until(lambda: sent.acks == 1)


class Broken(Hook):
    scope = "every"

    def received(self, delivery: Delivery, admission: Admission) -> None:
        raise RuntimeError("a bug in a hook")

    def before_batch(self, runs: Sequence[Run]) -> dict[Pack, str]:
        raise RuntimeError("a bug in a hook")


@pytest.mark.parametrize(
    ("thread", "error"),
    [
        # A hook fails to admit the message (the prepare thread).
        ("preparer", "internal error admitting the item: RuntimeError: a bug in a hook"),
        # A batch fails outside the model (the run thread).
        ("runner", "internal error running the batch: RuntimeError: a bug in a hook"),
    ],
)
def test_a_failure_outside_the_model_ends_each_item_with_the_error_and_the_message_is_acknowledged(
    start: Callable[..., Running], thread: str, error: str
) -> None:
    running = start()
    getattr(running.engine, thread).hooks = Hooks([Broken()])
    sent = message(RECORDER, ["a", "b"])
    running.send(sent)
    outcomes = running.stored(job_of(sent), 2)
    assert [o.error for o in outcomes] == [error] * 2
    assert Recorder.ran == []
    wait_until(lambda: sent.acks == 1)


def test_a_bug_past_admission_ends_every_item_of_the_message_once_and_it_is_acknowledged(
    start: Callable[..., Running], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The invalid item's check error, gathered before the bug, is replaced: one outcome per item.
    running = start()

    def broken(*args: object, **kwargs: object) -> Pack:
        raise RuntimeError("a bug of ours")

    monkeypatch.setattr(prepare_thread, "Pack", broken)
    sent = message(RECORDER, ["a", 5, "c"])
    running.send(sent)
    outcomes = running.stored(job_of(sent), 3)
    assert [o.error for o in outcomes] == [
        "internal error preparing the item: RuntimeError: a bug of ours"
    ] * 3
    assert Recorder.ran == []
    wait_until(lambda: sent.acks == 1)


def test_a_step_that_raises_ends_the_running_sequences_and_the_model_serves_on(
    start: Callable[..., Running],
) -> None:
    running = start(Settings(models=[STEP_FAILS]))
    doomed = message(STEP_FAILS, [{"count": 3}, {"count": 13}])
    running.send(doomed)
    outcomes = running.stored(job_of(doomed), 2)
    error = "the model failed while generating: RuntimeError: CUDA error: an illegal memory access was "
    error += "encountered"
    assert [o.error for o in outcomes] == [error, error]
    wait_until(lambda: doomed.acks == 1)
    later = message(STEP_FAILS, [{"count": 2}])
    running.send(later)
    assert [o.output for o in running.stored(job_of(later), 1)] == [{"counted": [1, 2]}]


def test_a_step_model_that_cannot_undo_a_failed_step_ends_its_items_and_every_later_one(
    start: Callable[..., Running],
) -> None:
    """No ``abort``: the engine ends the sequences it admitted and stops stepping the model, rather than step
    it again and again; an item the model refuses to admit ends alone, with the model's reason."""
    running = start(Settings(models=[STEP_FAILS_NO_ABORT]))
    refused = message(STEP_FAILS_NO_ABORT, [{"count": 7}, {"count": 2}])
    running.send(refused)
    outcomes = running.stored(job_of(refused), 2)
    assert outcomes[0].error == "the model could not admit the item: ValueError: seven is not admitted"
    assert outcomes[1].output == {"counted": [1, 2]}
    doomed = message(STEP_FAILS_NO_ABORT, [{"count": 3}, {"count": 13}])
    running.send(doomed)
    error = "the model failed while generating: RuntimeError: CUDA error: an illegal memory access was "
    broken = (
        f"{STEP_FAILS_NO_ABORT} stopped serving after a failed step it could not undo ({error}encountered)"
    )
    assert [o.error for o in running.stored(job_of(doomed), 2)] == [broken, broken]
    later = message(STEP_FAILS_NO_ABORT, [{"count": 2}])
    running.send(later)
    assert [o.error for o in running.stored(job_of(later), 1)] == [broken]
    wait_until(lambda: doomed.acks == 1 and later.acks == 1)


COUNTED = [({"counted": [1, 2]}, None), ({"counted": [1, 2, 3]}, None)]


@pytest.mark.parametrize(
    ("model", "outcomes"),
    [
        ("StepTwice", COUNTED),  # the second report of each is ignored: the message settles once
        ("StepMadeUp", COUNTED),
        ("StepNeither", [(None, "the model returned no output (None) for this item")] * 2),
        ("StepNaN", [(None, "the model returned nan for this item, which JSON cannot hold")] * 2),
        (
            "StepNone",
            "stopped serving after a failed step it could not undo (the model failed while generating: "
            "TypeError: 'NoneType' object is not iterable)",
        ),
        ("RunningFails", "stopped serving after its running() failed: RuntimeError: running() broke"),
        ("CanAdmitFails", "stopped serving after admitting failed: RuntimeError: can_admit() broke"),
    ],  # fmt: skip
)
def test_a_step_model_that_breaks_its_contract_ends_each_item_once_and_the_engine_serves_on(
    start: Callable[..., Running], model: str, outcomes: Any
) -> None:
    name = f"tests.support.models:{model}"
    running = start(Settings(models=[name, RECORDER]))
    sent = message(name, [{"count": 2}, {"count": 3}])
    running.send(sent)
    if isinstance(outcomes, str):
        outcomes = [(None, f"{name} {outcomes}")] * 2
    assert [(o.output, o.error) for o in running.stored(job_of(sent), 2)] == outcomes
    wait_until(lambda: sent.acks == 1)
    other = message(RECORDER, ["still served"])
    running.send(other)
    assert [o.output for o in running.stored(job_of(other), 1)] == ["STILL SERVED"]


def test_a_model_that_calls_sys_exit_fails_its_item_and_the_engine_serves_on(
    start: Callable[..., Running],
) -> None:
    running = start(Settings(models=[EXITS]))
    sent = message(EXITS, ["a", "exit", "b"])
    running.send(sent)
    assert [(o.output, o.error) for o in running.stored(job_of(sent), 3)] == [
        ("a", None), (None, "SystemExit: 3"), ("b", None)
    ]  # fmt: skip
    assert running.engine.stalled_s() == 0


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_engine_thread_stalls_the_worker_so_other_workers_take_its_work(
    start: Callable[..., Running],
) -> None:
    # A stalled worker fetches nothing and stops renewing its leases (outbox.py): what it held goes to
    # another worker, where a thread that died would hold it for good.
    running = start(Settings(models=[EXITS]))
    running.send(message(EXITS, ["interrupt"]))
    wait_until(lambda: running.clock.advance(1) or running.engine.stalled_s() == math.inf)
