"""The prepare thread: decode each message, check its items once, prepare them (tokenize) in one call, and
queue them for batching.

A message that is not a valid call is refused whole; an item the model cannot take ends with its own error;
suspects (items of a message whose worker died) go to the isolated lane or end as errors past the delivery
cap. It never runs a model's forward pass and never waits on the database.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

import orjson

from worker.batching.scheduler import Item, Scheduler
from worker.calls import InferMessage, check_item, item_id, parse_message, plain_items
from worker.errors import MODEL_FAILURES, InvalidInput
from worker.models.base import Model, StepModel
from worker.runtime.deliveries import Delivery, Holdings, Pack, Refusal, ResultsToStore, ToStore
from worker.runtime.forward import error_text
from worker.runtime.hooks import Admission, Hooks
from worker.runtime.loaded_models import ISOLATED, LoadedModels
from worker.settings import Settings
from worker.store.values import ItemRecord

log = logging.getLogger(__name__)

# Messages taken together at most: their items reach the scheduler in one go, or in parts of this many.
MAX_GROUP = 256
MAX_GROUP_ITEMS = 2048


class Preparer:
    def __init__(
        self,
        settings: Settings,
        models: LoadedModels,
        scheduler: Scheduler,
        ready: threading.Condition,
        results: ToStore,
        holdings: Holdings,
        hooks: Hooks,
        clock: Callable[[], float],
    ) -> None:
        self.settings, self.models, self.scheduler = settings, models, scheduler
        self.ready = ready  # guards the scheduler; notified when items were added
        self.results = results  # the store thread's queue
        self.holdings, self.hooks, self.clock = holdings, hooks, clock
        self.deliveries: queue.SimpleQueue[Delivery | None] = queue.SimpleQueue()

    def loop(self) -> None:
        """Take every message waiting, then hand all their items to the scheduler at once: one lock and one
        wake-up of the run thread per group, not per message (single-item calls arrive by the thousand)."""
        while True:
            group, last = self._waiting()
            items: list[Run] = []
            count = 0  # items in ``items``
            for delivery in group:
                try:
                    self.take(delivery, items)
                except Exception:  # never let one message stop the prepare thread
                    log.exception("could not take message %s", delivery.task_id[:80])
                    if delivery.call is None:
                        self.results.put(Refusal(delivery, "internal error while preparing the message"))
                count += delivery.pending
                if count >= MAX_GROUP_ITEMS:
                    self._schedule(items)  # large messages: the run thread need not wait for all
                    items, count = [], 0
            # Read once their items are held (the throttle counts them twice a moment, never not at all).
            self.holdings.read(group)
            self._schedule(items)
            if last:
                return

    def _schedule(self, items: list[Run]) -> None:
        if items:
            with self.ready:
                for model, lane, run in items:
                    self.scheduler.add_run(model, lane, run)
                self.ready.notify()

    def _waiting(self) -> tuple[list[Delivery], bool]:
        """The next delivery (waiting for one) and those queued behind it; True once the end is seen."""
        group: list[Delivery] = []
        delivery = self.deliveries.get()
        while delivery is not None:
            group.append(delivery)
            if len(group) >= MAX_GROUP:
                return group, False
            try:
                delivery = self.deliveries.get_nowait()
            except queue.Empty:
                return group, False
        return group, True

    def take(self, delivery: Delivery, items: list[Run]) -> None:
        """Parse and check ``delivery``; its items to batch go to ``items`` as runs (model, lane, items).

        Its errors and runs are gathered first and handed on together, so that whatever fails part way (a
        hook, a bug of ours) has handed on nothing yet: every item then ends with that error, and the
        message is settled rather than held for good."""
        call = self._parse(delivery)
        if call is None:
            return
        delivery.call = call
        delivery.pending = len(call.inputs)
        self.holdings.hold(call, len(call.inputs))
        failed, runs = ResultsToStore(), list[Run]()
        try:
            self._admit(delivery, call, failed, runs)
        except Exception as exc:
            log.exception("preparing message %s failed", delivery.task_id[:80])
            failed, runs = ResultsToStore(), []
            error = f"internal error preparing the item: {error_text(exc)}"
            self._fail(failed, delivery, range(len(call.inputs)), error)
        if len(failed):
            self.results.put(failed)
        items.extend(runs)

    def _admit(self, delivery: Delivery, call: InferMessage, failed: ResultsToStore, runs: list[Run]) -> None:
        try:
            admission = self.hooks.received(delivery)
        except Exception as exc:  # a hook's bug
            log.exception("admitting message %s failed", delivery.task_id[:80])
            error = f"internal error admitting the item: {error_text(exc)}"
            self._fail(failed, delivery, range(len(call.inputs)), error)
            return
        try:
            model = self.models.get(call.model)
        except MODEL_FAILURES as exc:
            log.error("model %s failed to load: %s", call.model, error_text(exc))
            error = f"model {call.model!r} failed to load: {error_text(exc)}"
            self._fail(failed, delivery, range(len(call.inputs)), error)
            return
        positions, isolated = self._positions(delivery, admission, failed)
        valid, checked, ids = self._check(model, delivery, positions, failed)
        self._prepare(delivery, model, Checked(valid, checked, ids), isolated, failed, runs)

    def _parse(self, delivery: Delivery) -> InferMessage | None:
        try:
            body = _decoded(delivery.message)
        except Exception as exc:  # orjson's or kombu's (a content type it refuses): no common type
            reason = f"invalid message: its body cannot be read: {error_text(exc)}"
            self.results.put(Refusal(delivery, reason[:2000]))
            return None
        try:
            args, kwargs, _embed = body
            if args:
                raise InvalidInput("infer takes keyword arguments only")
            return parse_message(delivery.task_id, kwargs, self.settings)
        except (InvalidInput, TypeError, ValueError) as exc:
            self.results.put(Refusal(delivery, f"invalid message: {exc}"[:2000]))
            return None

    def _positions(
        self, delivery: Delivery, admission: Admission, failed: ResultsToStore
    ) -> tuple[list[int], set[int]]:
        """The message's items to run, and of those the ones that must run alone; the items hooks ended at
        once are stored with their errors (hooks/journal.py: suspects past the delivery cap)."""
        call = delivery.call
        assert call is not None
        everything = list(range(len(call.inputs)))
        if not admission.ended and not admission.alone:
            return everything, set()
        for position, error in admission.ended.items():
            log.error("job %s item %d: %s", call.job_id, call.index(position), error)
            self._fail(failed, delivery, [position], error)
        return [p for p in everything if p not in admission.ended], admission.alone

    def _check(
        self, model: Model, delivery: Delivery, positions: list[int], failed: ResultsToStore
    ) -> tuple[list[int], list[Any], list[str | None]]:
        """The positions whose items pass the model's check, what the check made of them and their ids; the
        errors of the rest go to ``failed``."""
        call = delivery.call
        assert call is not None
        every = len(positions) == len(call.inputs)
        plain = plain_items(
            type(model), call.inputs if every else [call.inputs[p] for p in positions], self.settings
        )
        if plain is not None:  # all plain texts: checked a message at a time, ids included
            return positions, plain[0], plain[1] or [None] * len(positions)
        valid, checked, ids = [], [], []
        cls, settings, offset, inputs, indices = (
            type(model),
            self.settings,
            call.offset,
            call.inputs,
            call.indices,
        )
        for position in positions:
            index, raw = offset + position if indices is None else indices[position], inputs[position]
            try:
                ready, ident = check_item(cls, index, raw, settings)
            except InvalidInput as exc:
                error = f"invalid input: {exc.detail}"
                failed.add(ItemRecord(call.job_id, index, _safe_id(index, raw), error=error), delivery)
            else:
                valid.append(position)
                checked.append(ready)
                ids.append(ident)
        return valid, checked, ids

    def _prepare(
        self,
        delivery: Delivery,
        model: Model,
        checked: Checked,
        isolated: set[int],
        failed: ResultsToStore,
        items: list[Run],
    ) -> None:
        """Prepare the checked items in one call and add them to ``items`` as one run per lane, every Item
        referring to the message's Pack (its payloads and ids as columns); if preparing fails, their errors
        go to ``failed``."""
        call = delivery.call
        assert call is not None
        positions = checked.positions
        if not positions:
            return
        try:
            payloads, lengths = _prepared(model, checked.values)
        except MODEL_FAILURES as exc:
            self._fail(failed, delivery, positions, f"could not prepare input: {error_text(exc)}")
            return
        size = len(call.inputs)
        every = len(positions) == size
        pack = Pack(
            delivery,
            call.offset,
            payloads if every else _by_position(positions, payloads, size),
            _ids_by_position(positions, checked.ids, size, every),
            suspect=bool(delivery.lost),
            isolated=frozenset(isolated),
            where=None if call.indices is None else {index: p for p, index in enumerate(call.indices)},
        )
        now, job_id, offset = self.clock(), call.job_id, call.offset
        if call.indices is None:
            indices = [offset + position for position in positions]
        else:
            indices = [call.indices[position] for position in positions]
        if lengths is None:
            run = [Item(job_id, index, 1, now, pack) for index in indices]
        else:
            # Shortest first: a message's items arrive together, and taken in this order each batch cut from
            # a bucket holds the closest lengths (the producer ordered them only by characters). A model run
            # step by step admits its items one at a time, in the message's order.
            made = (
                Item(job_id, index, length, now, pack) for index, length in zip(indices, lengths, strict=True)
            )
            run = list(made) if isinstance(model, StepModel) else sorted(made, key=attrgetter("length"))
        if isolated:
            items.append(
                (call.model, ISOLATED, [item for item in run if pack.position(item.index) in isolated])
            )
            run = [item for item in run if pack.position(item.index) not in isolated]
        items.append((call.model, call.priority, run))

    def _fail(self, failed: ResultsToStore, delivery: Delivery, positions: Iterable[int], error: str) -> None:
        """``error`` for these items of the delivery, to ``failed`` (they will not run)."""
        call = delivery.call
        assert call is not None
        for position in positions:
            index = call.index(position)
            failed.add(
                ItemRecord(call.job_id, index, _safe_id(index, call.inputs[position]), error=error), delivery
            )


# A run of a message's items for one lane: (model, lane, items in index order).
Run = tuple[str, str, list[Item]]


@dataclass(frozen=True, slots=True)
class Checked:
    """A message's items that passed the check: their positions, checked forms and user ids."""

    positions: list[int]
    values: list[Any]
    ids: list[str | None]


def _prepared(model: Model, checked: list[Any]) -> tuple[list[Any], list[int] | None]:
    """The payloads ``model.prepare`` makes of ``checked``, and their lengths (None: 1 each, the default
    prepare's, which is skipped: it would make an object per item only to say so)."""
    if type(model).prepare is Model.prepare:
        return checked, None
    prepared = model.prepare(checked)
    if len(prepared) != len(checked):
        raise RuntimeError(f"prepare returned {len(prepared)} payloads for {len(checked)} items")
    return [ready.payload for ready in prepared], [ready.length for ready in prepared]


def _by_position(positions: list[int], values: list[Any], size: int) -> list[Any]:
    full: list[Any] = [None] * size
    for position, value in zip(positions, values, strict=True):
        full[position] = value
    return full


def _ids_by_position(
    positions: list[int], ids: list[str | None], size: int, every: bool
) -> list[str | None] | None:
    if ids.count(None) == len(ids):
        return None
    return ids if every else _by_position(positions, ids, size)


def _decoded(message: Any) -> Any:
    """A JSON message's body read by orjson (kombu's reader is several times slower, and single-item calls
    come by the thousand); any other content type through kombu, which enforces the accepted ones."""
    kind = getattr(message, "content_type", None), getattr(message, "content_encoding", None)
    if kind in (("application/json", "utf-8"), ("application/json", "utf8")):
        return orjson.loads(message.body)
    return message.decode()


def _safe_id(index: int, item: object) -> str | None:
    """The item's user id, or None where the id itself is what is wrong with it."""
    try:
        return item_id(index, item)
    except InvalidInput:
        return None
