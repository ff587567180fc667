"""The batching engine inside one worker: deliveries in, stored outcomes and acks out.

Three threads, one way: *prepare* decodes messages, checks and tokenizes their items and adds
them to the scheduler; *run* takes the next batch when the model is free and runs it (or, for a
model driven step by step, admits waiting items and runs one step); *store* (storing.py) commits
each batch's outcomes in one transaction and only then acknowledges the messages whose items are
all stored. The model never waits for receiving, tokenizing or storing.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from datetime import UTC, datetime
from typing import NamedTuple

from worker.batching.backoff import SizeLimit
from worker.batching.policy import LanePolicy, ModelKnobs, lane_policy
from worker.batching.scheduler import Batch, Item, LaneKey, Scheduler
from worker.calls import InferCall, parse_call
from worker.models.base import InvalidInput, Model, StepModel
from worker.models.device import device_kind
from worker.models.registry import model_class
from worker.runtime.deliveries import Acks, Delivery, Holdings, Message, Slot, TaskEvents, Write
from worker.runtime.runner import Report, describe, run_batch
from worker.runtime.storing import Storer
from worker.runtime.tuned import TunedLimitsWatcher
from worker.settings import Batching, Settings
from worker.store.results import BatchRecord, ItemOutcome, ResultStore, TokenCount
from worker.store.tuned import TunedLimits

log = logging.getLogger(__name__)

CANCEL_CHECK_S = 1.0


class Stepping(NamedTuple):
    """A model driven step by step, under the name its messages use (a registry name or import path)."""

    name: str
    model: StepModel


class Engine:
    def __init__(
        self,
        settings: Settings,
        store: ResultStore,
        acks: Acks,
        events: TaskEvents,
        *,
        device: str = "cpu",
        worker_name: str = "batchwork",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.store = store
        self.acks = acks
        self.events = events
        self.device = device
        self.worker_name = worker_name
        self.clock = clock
        self.scheduler = Scheduler(self.policy_for)
        self.models: dict[str, Model] = {}
        self.ready = threading.Event()
        self.holdings = Holdings()
        self.storer = Storer(store, acks, events, self.holdings)
        self.tuned = TunedLimitsWatcher(
            TunedLimits(store.engine),
            device_kind(device),
            settings.tuned_refresh_s,
            worker_name,
            self._retune,
        )
        self._intake: queue.SimpleQueue[Delivery | None] = queue.SimpleQueue()
        self._writes = self.storer.writes
        self._lock = threading.Condition()
        self._limits: dict[str, SizeLimit] = {}
        self._cancelled: set[str] = set()
        self._cancelled_checked = float("-inf")
        self._tokens_reported: dict[str, float] = {}  # model name -> when its token counts were last sent
        self._stopping = False
        self._finish_waiting = False
        self._threads = [
            threading.Thread(target=self._prepare_loop, name="batchwork-prepare", daemon=True),
            threading.Thread(target=self._run_loop, name="batchwork-run", daemon=True),
            threading.Thread(target=self.storer.loop, name="batchwork-store", daemon=True),
        ]

    # -- control ---------------------------------------------------------------------------

    def start(self, preload: Iterable[str] = ()) -> None:
        self.tuned.start()
        for name in preload:
            self.model(name)
        for thread in self._threads:
            thread.start()
        self.ready.set()

    def accept(self, message: Message) -> None:
        """Called by the consumer for each message; must return at once."""
        delivery = Delivery(message, self.clock())
        self.holdings.received(delivery)
        self._intake.put(delivery)

    def broker_lost_messages(self) -> None:
        """The broker came back empty: see Storer.broker_lost_messages."""
        self.storer.broker_lost_messages(self.settings.lost_grace_s)

    def stop(self, *, finish_waiting: bool, timeout_s: float = 60.0) -> None:
        """Stop after the batch in flight, storing and acking what ran.

        With ``finish_waiting`` every waiting item runs first (the embedded run). Without it, the
        messages of items that did not run stay unacknowledged, and the broker hands them to
        another worker when this one's channel closes.
        """
        prepare, run, store = self._threads
        self._intake.put(None)
        prepare.join(timeout_s)
        with self._lock:
            self._stopping = True
            self._finish_waiting = finish_waiting
            self._lock.notify_all()
        run.join(timeout_s)
        self._writes.put(None)
        store.join(timeout_s)
        self.tuned.stop()

    def policy_for(self, lane: LaneKey) -> LanePolicy:
        model, priority = lane
        cls = model_class(model)
        defaults = ModelKnobs(cls.max_batch_size, cls.max_wait_ms, cls.max_batch_tokens, cls.bucket_edges)
        knobs = self.settings.batching.get(model, Batching()).over(self.tuned.knobs(model))
        policy = lane_policy(knobs.resolve(defaults), priority)
        return replace(policy, continuous=True) if issubclass(cls, StepModel) else policy

    def _retune(self, models: set[str]) -> None:
        """Tuned limits changed (called on the watcher's thread): the lanes take them at once."""
        with self._lock:
            for model in models:
                self.scheduler.reconfigure(model)
            self._lock.notify()

    def model(self, name: str) -> Model:
        model = self.models.get(name)
        if model is None:
            model = model_class(name)(self.settings)
            model.load(self.device)
            self.models[name] = model
        return model

    # -- prepare ---------------------------------------------------------------------------

    def _prepare_loop(self) -> None:
        while (delivery := self._intake.get()) is not None:
            try:
                self._prepare(delivery)
            except Exception:  # never let one message stop the intake
                log.exception("could not take message %s", delivery.task_id)
                self._fail_message(delivery, "internal error while preparing the message")

    def _prepare(self, delivery: Delivery) -> None:
        try:
            _args, kwargs, _embed = delivery.message.decode()
            call = delivery.call = parse_call(delivery.task_id, kwargs, self.settings)
        except (InvalidInput, TypeError, ValueError) as exc:
            self._fail_message(delivery, f"invalid message: {exc}")
            return
        delivery.pending = len(call.inputs)
        self.holdings.hold(call, len(call.inputs))
        self.events.received(delivery)
        try:
            model = self.model(call.model)
        except Exception as exc:
            self._write_errors(
                delivery, range(len(call.inputs)), f"model {call.model!r} failed to load: {exc}"
            )
            return
        valid, errors = self._check(model, call)
        self._queue_errors(delivery, errors)
        self._enqueue(delivery, model, valid)

    def _check(self, model: Model, call: InferCall) -> tuple[list[int], list[ItemOutcome]]:
        valid, errors = [], []
        for position, raw in enumerate(call.inputs):
            index = call.offset + position
            try:
                model.validate(index, raw, self.settings.max_input_chars)
            except InvalidInput as exc:
                errors.append(
                    ItemOutcome(call.job_id, index, model.item_id(raw), error=f"invalid input: {exc.detail}")
                )
            else:
                valid.append(position)
        return valid, errors

    def _enqueue(self, delivery: Delivery, model: Model, positions: list[int]) -> None:
        call = delivery.call
        assert call is not None
        if not positions:
            return
        raws = [call.inputs[p] for p in positions]
        try:
            prepared = model.prepare(raws)
        except Exception as exc:
            self._write_errors(delivery, positions, f"could not prepare input: {describe(exc)}")
            return
        now = self.clock()
        with self._lock:
            for position, raw, ready in zip(positions, raws, prepared, strict=True):
                slot = Slot(delivery, model.item_id(raw), ready.payload)
                item = Item(call.job_id, call.offset + position, ready.length, now, slot)
                self.scheduler.add(call.model, call.priority, item)
            self._lock.notify()

    def _fail_message(self, delivery: Delivery, error: str) -> None:
        log.warning("message %s refused: %s", delivery.task_id, error)
        delivery.error = error
        self._writes.put(Write(None, deliveries=[delivery]))

    def _write_errors(self, delivery: Delivery, positions: Iterable[int], error: str) -> None:
        call = delivery.call
        assert call is not None
        outcomes = [
            ItemOutcome(call.job_id, call.offset + p, Model.item_id(call.inputs[p]), error=error)
            for p in positions
        ]
        self._queue_errors(delivery, outcomes)

    def _queue_errors(self, delivery: Delivery, outcomes: list[ItemOutcome]) -> None:
        if outcomes:
            self._writes.put(Write(None, outcomes, [delivery] * len(outcomes)))

    # -- run -------------------------------------------------------------------------------

    def _run_loop(self) -> None:
        while (work := self._next_work()) is not None:
            for unit in work:
                try:
                    if isinstance(unit, Batch):
                        self._writes.put(self._run(unit))
                    else:
                        self._step(unit)
                except Exception:  # the runner isolates model errors; this is a bug of ours
                    log.exception("running %s failed", unit)

    def _next_work(self) -> list[Batch | Stepping] | None:
        """What to run now: a ready batch, and one step of every continuously batched model with work.

        None once stopping and nothing is left to finish.
        """
        with self._lock:
            while True:
                now = self.clock()
                if self._stopping and not self._finish_waiting:
                    return None
                work: list[Batch | Stepping] = [s for s in self._steppers() if self._has_steps(s)]
                batch = self.scheduler.next_batch(now, flush=self._stopping)
                if batch is not None:
                    work.insert(0, batch)
                if work or self._stopping:
                    return work or None
                deadline = self.scheduler.next_deadline()
                self._lock.wait(None if deadline is None else max(0.0, deadline - now))

    def _steppers(self) -> list[Stepping]:
        # list(): the prepare thread may add a model meanwhile; copying the items is atomic.
        return [Stepping(n, m) for n, m in list(self.models.items()) if isinstance(m, StepModel)]

    def _has_steps(self, stepping: Stepping) -> bool:
        return stepping.model.running() > 0 or self.scheduler.waiting_for(stepping.name) > 0

    def _step(self, stepping: Stepping) -> None:
        """Continuous batching: admit waiting items while there is room, then advance every sequence."""
        self._refresh_cancelled()
        name, model = stepping
        write, now = Write(None), self.clock()
        while model.running() < model.max_running:
            with self._lock:
                item = self.scheduler.admit_next(name, now, model.can_admit)
            if item is None:
                break
            if not self._dropped(item, write):
                self._mark_started(item.ref.delivery)
                model.admit(item, item.ref.payload)
        for finished in model.step():
            item, slot = finished.key, finished.key.ref
            outcome = ItemOutcome(
                item.job_id, item.index, slot.item_id, finished.output, finished.error, finished.tokens
            )
            write.add(outcome, slot.delivery)
        if write.outcomes:
            self._writes.put(write)
        self._report_tokens(stepping)

    def _report_tokens(self, stepping: Stepping) -> None:
        """Every ``tokens_report_s``, the token counts of the running sequences (all of them: a running
        sequence gains a token every step, so nearly every count has changed since the last report).

        A report names only sequences still running and is queued behind the results of earlier steps;
        one that reaches the store after its item's result anyway (a redelivered item run twice) cannot
        change the count stored with the result.
        """
        now = self.clock()
        name, model = stepping
        if now - self._tokens_reported.get(name, float("-inf")) < self.settings.tokens_report_s:
            return
        self._tokens_reported[name] = now
        counts = [TokenCount(item.job_id, item.index, tokens) for item, tokens in model.progress()]
        if counts:
            self._writes.put(Write(None, tokens=counts))

    def _mark_started(self, delivery: Delivery) -> None:
        if not delivery.started:
            delivery.started = True
            self.events.started(delivery)

    def _run(self, batch: Batch) -> Write:
        write = Write(None)
        batch = self._screen(batch, write)
        if not batch.items:
            return write
        slots: list[Slot] = [item.ref for item in batch.items]
        for slot in slots:
            self._mark_started(slot.delivery)
        started_at, started = datetime.now(UTC), self.clock()
        model = self.models[batch.model]
        report = run_batch(model.forward, [slot.payload for slot in slots], model.release_memory)
        run_ms = (self.clock() - started) * 1000
        self._adapt_size(batch, report)
        write.record = BatchRecord(
            model=batch.model,
            lane=batch.lane[1],
            size=len(batch.items),
            real_tokens=batch.real_tokens,
            padded_tokens=batch.padded_tokens,
            wait_ms=batch.oldest_wait_s * 1000,
            run_ms=run_ms,
            started_at=started_at,
            worker=self.worker_name,
        )
        for item, slot, outcome in zip(batch.items, slots, report.outcomes, strict=True):
            write.add(
                ItemOutcome(item.job_id, item.index, slot.item_id, outcome.output, outcome.error),
                slot.delivery,
            )
        log.info(
            "batch %s/%s: %d items, tokens %d real / %d padded, oldest waited %.1f ms, ran %.1f ms",
            *(batch.model, batch.lane[1], len(slots), batch.real_tokens, batch.padded_tokens),
            *(batch.oldest_wait_s * 1000, run_ms),
        )
        return write

    def _screen(self, batch: Batch, write: Write) -> Batch:
        """The batch without items of cancelled jobs or past their job's deadline; those end as errors."""
        self._refresh_cancelled()
        live = tuple(item for item in batch.items if not self._dropped(item, write))
        return batch if len(live) == len(batch.items) else Batch(batch.lane, live, batch.formed_at)

    def _dropped(self, item: Item, write: Write) -> bool:
        """Store why ``item`` must not run (its job was cancelled or its deadline passed), if so."""
        slot: Slot = item.ref
        call = slot.delivery.call
        assert call is not None
        if call.job_id in self._cancelled:
            error = "cancelled"
        elif call.expires_at is not None and time.time() > call.expires_at:
            error = "expired: not started before the job's deadline"
        else:
            return False
        write.add(ItemOutcome(item.job_id, item.index, slot.item_id, error=error), slot.delivery)
        return True

    def _refresh_cancelled(self) -> None:
        """At most once a second, ask the store which jobs held here were cancelled."""
        now = self.clock()
        if now - self._cancelled_checked < CANCEL_CHECK_S:
            return
        self._cancelled_checked = now
        try:
            self._cancelled = self.store.cancelled(self.holdings.jobs())
        except Exception as exc:  # a database outage must not stop the model; try again later
            log.warning("could not check for cancelled jobs: %s", exc)

    def _adapt_size(self, batch: Batch, report: Report) -> None:
        """Lower a model's N at once when a batch ran out of memory; let it grow back slowly."""
        limit = self._limits.setdefault(batch.model, SizeLimit())
        before = limit.cap
        if report.out_of_memory_at is not None:
            limit.ran_out_of_memory(report.out_of_memory_at, report.largest_ok)
            self.tuned.record_out_of_memory(batch.model, report.out_of_memory_at)
        else:
            limit.succeeded(len(batch.items), self.policy_for(batch.lane).max_batch_size)
        if limit.cap != before:
            log.warning("%s: batches now hold at most %s items", batch.model, limit.cap or "N")
            with self._lock:
                self.scheduler.cap_size(batch.model, limit.cap)
