"""The run thread: take the next batch when the model is free and run it, or, for a model driven step by step,
admit waiting items and run one step; hand every outcome to the store thread.

It owns the device and waits on nothing else: results leave through the store thread's queue, and the
hooks (hooks/) are called before and after each batch: they may drop a message's items (cancellation,
deadlines) and must not wait, except the journal of suspect items (items of a message whose worker died),
written before they run: rare, and it must be durable before a crash it may witness.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import UTC, datetime
from itertools import groupby
from operator import attrgetter
from typing import Any

from worker.batching.scheduler import Batch, Item, Scheduler
from worker.errors import MODEL_FAILURES
from worker.models.base import FinishedSequence
from worker.runtime.deliveries import Pack, ResultsToStore, TokenReport, ToStore
from worker.runtime.forward import error_text, output_error, run_batch
from worker.runtime.hooks import Hooks, Ran, Run
from worker.runtime.loaded_models import LoadedModels, Stepping
from worker.settings import Settings
from worker.store.values import BatchRecord, ItemRecord, TokenCount

log = logging.getLogger(__name__)

Work = Batch | Stepping


class Runner:
    def __init__(
        self,
        settings: Settings,
        models: LoadedModels,
        scheduler: Scheduler,
        ready: threading.Condition,
        results: ToStore,
        hooks: Hooks,
        clock: Callable[[], float],
        worker_name: str,
        ran_out_of_memory: Callable[[str, int], None] = lambda model, size: None,
    ) -> None:
        self.tokens_report_s = settings.tokens_report_s
        self.models, self.scheduler = models, scheduler
        self.ready = ready  # guards the scheduler; the prepare thread notifies it when items arrive
        self.results = results  # the store thread's queue
        self.hooks, self.clock = hooks, clock
        self.worker_name = worker_name
        self.ran_out_of_memory = ran_out_of_memory  # records the size that failed, off this thread
        self._stopping = False
        self._tokens_reported: dict[str, float] = {}  # model name -> when its token counts were last sent
        self._alone: dict[str, Item] = {}  # model name -> the isolated sequence running by itself
        self._admitted: dict[str, dict[tuple[str, int], Item]] = {}  # model name -> its running items
        self._broken: dict[str, str] = {}  # model name -> why it serves nothing more (see _stepped)

    def stop(self) -> None:
        """Stop after the batch (or step) in flight; what waits stays unacknowledged, for another worker."""
        with self.ready:
            self._stopping = True
            self.ready.notify_all()

    def loop(self) -> None:
        while (work := self._next_work()) is not None:
            for unit in work:
                try:
                    if isinstance(unit, Batch):
                        self.results.put(self._run_or_fail(unit))
                    else:
                        self._step(unit)
                except Exception:  # run_batch isolates model errors; this is a bug of ours
                    log.exception("running %s failed", unit)

    def _run_or_fail(self, batch: Batch) -> ResultsToStore:
        """The batch's outcomes; if running it failed outside the model (a bug of ours, or a hook's), each of
        its items ends with that error: they left the scheduler, and nothing else would ever settle them."""
        try:
            return self._run(batch)
        except Exception as exc:
            log.exception("running %s failed", batch)
            error = f"internal error running the batch: {error_text(exc)}"
            runs, write = _runs(batch.items), ResultsToStore()
            _store_dropped(dict.fromkeys((pack for pack, _ in runs), error), runs, write)
            return write

    def _next_work(self) -> list[Work] | None:
        """A ready batch, and one step of every continuously batched model with work; None once stopping."""
        with self.ready:
            while True:
                if self._stopping:
                    return None
                now = self.clock()
                work: list[Work] = [s for s in self.models.steppers() if self._has_steps(s)]
                batch = self.scheduler.next_batch(now)
                if batch is not None:
                    work.insert(0, batch)
                if work:
                    return work
                deadline = self.scheduler.next_deadline()
                self.ready.wait(None if deadline is None else max(0.0, deadline - now))

    # -- batches ----------------------------------------------------------------------------

    def _run(self, batch: Batch) -> ResultsToStore:
        write = ResultsToStore()
        every = _runs(batch.items)
        runs, dropped = self.hooks.before_batch(every)
        if dropped:
            _store_dropped(dropped, every, write)
            batch = Batch(batch.key, tuple(item for _, mine in runs for item in mine), batch.formed_at)
        if not batch.items:
            return write
        started_at, started = datetime.now(UTC), self.clock()
        model = self.models.loaded(batch.model)
        # Per message, not per item: each run's job indices once, its payloads and ids looked up a column at
        # a time.
        indices = [list(map(_INDEX, mine)) for _, mine in runs]
        payloads = [p for (pack, _), mine in zip(runs, indices, strict=True) for p in pack.payloads_of(mine)]
        report = run_batch(model.forward, payloads, model.release_memory)
        run_ms = (self.clock() - started) * 1000
        with self.ready:
            changed, cap = self.scheduler.batch_ran(batch, report.out_of_memory_at, report.largest_ok)
        if changed:
            log.warning("%s: batches now hold at most %s items", batch.model, cap or "N")
        if report.out_of_memory_at is not None:
            self.ran_out_of_memory(batch.model, report.out_of_memory_at)
        write.record = BatchRecord(
            model=batch.model,
            lane=batch.lane,
            size=len(batch.items),
            real_tokens=batch.real_tokens,
            padded_tokens=batch.padded_tokens,
            wait_ms=batch.oldest_wait_s * 1000,
            run_ms=run_ms,
            started_at=started_at,
            worker=self.worker_name,
        )
        self.hooks.after_batch(runs, Ran(write.record, report))
        start = 0
        for (pack, mine), mine_indices in zip(runs, indices, strict=True):
            end = start + len(mine)
            write.extend(
                pack.delivery,
                mine_indices,
                pack.ids_of(mine_indices),
                report.outputs[start:end],
                report.errors[start:end],
            )
            start = end
        log.debug(  # per batch: at info level, 12.5% of a worker's samples under many small batches
            "batch %s/%s: %d items, tokens %d real / %d padded, oldest waited %.1f ms, ran %.1f ms",
            *(batch.model, batch.lane, len(batch.items), batch.real_tokens, batch.padded_tokens),
            *(batch.oldest_wait_s * 1000, run_ms),
        )
        return write

    # -- steps (continuous batching) ------------------------------------------------------------

    def _has_steps(self, stepping: Stepping) -> bool:
        name = stepping.name
        if name in self._broken:  # its own count is not to be trusted: only what this thread knows is work
            return bool(self._admitted.get(name)) or self.scheduler.waiting_for(name) > 0
        try:
            return stepping.model.running() > 0 or self.scheduler.waiting_for(name) > 0
        except MODEL_FAILURES as exc:
            self._break(name, f"its running() failed: {error_text(exc)}")
            return True

    def _step(self, stepping: Stepping) -> None:
        """Continuous batching: admit waiting items while there is room, then advance every sequence.

        A step model's own methods are its author's code: one that raises where it has no way to recover
        (see ``_stepped``) breaks the model, never this thread, and its items end with the reason."""
        name, model = stepping
        write, now = ResultsToStore(), self.clock()
        if name not in self._broken:
            try:
                while model.running() < model.max_running and name not in self._alone:
                    with self.ready:
                        item = self.scheduler.admit_next(name, now, lambda item: self._fits(stepping, item))
                    if item is None:
                        break
                    self._admit(stepping, item, write)
            except MODEL_FAILURES as exc:
                self._break(name, f"admitting failed: {error_text(exc)}")
        finished = self._stepped(stepping) if name not in self._broken else []
        if name in self._broken:  # every item it holds or that waits for it ends: it serves nothing more
            error = self._broken[name]
            with self.ready:
                waiting = list(iter(lambda: self.scheduler.admit_next(name, now, lambda item: True), None))
            finished += [
                FinishedSequence(item, error=error) for item in self._admitted.get(name, {}).values()
            ]
            for refused in waiting:
                self._end(name, refused, FinishedSequence(refused, error=error), write)
        for sequence in finished:
            self._finish(name, sequence, write)
        if len(write):
            self.results.put(write)
        if name not in self._broken:
            self._report_tokens(stepping)

    def _finish(self, name: str, finished: Any, write: ResultsToStore) -> None:
        """A sequence the model says has finished: its item's outcome, once. A key the model was not running
        (one it made up, or finished before) is logged and ignored: storing it would settle its message
        twice, or settle another message."""
        key = getattr(finished, "key", None)
        if (
            not isinstance(finished, FinishedSequence)
            or not isinstance(key, Item)
            or self._admitted.get(name, {}).pop((key.job_id, key.index), None) is None
        ):
            log.error("%s finished a sequence it was not running (%.200r); ignored", name, finished)
            return
        self._end(name, key, finished, write)

    def _end(self, name: str, item: Item, finished: FinishedSequence, write: ResultsToStore) -> None:
        pack: Pack = item.ref
        if self._alone.get(name) is item:
            del self._alone[name]
        self.hooks.after_batch([(pack, (item,))], None)
        output, error = finished.output, finished.error
        if error is None and (error := output_error(output)) is not None:
            output = None  # None, or NaN: neither an answer nor a failure as it stands
        outcome = ItemRecord(
            item.job_id, item.index, pack.item_id(item.index), output, error, finished.tokens
        )
        write.add(outcome, pack.delivery)

    def _stepped(self, stepping: Stepping) -> list[FinishedSequence]:
        """One step's finished sequences; if the step raised (the device out of memory part way through a
        decode, a bug) or gave no list, every admitted sequence ends with that error, or each later step
        would fail alike and their items never end. A model that cannot end them (no ``abort``, or it
        raised too) is broken: ``_step`` ends the items it admitted, and every later one, itself."""
        name, model = stepping
        try:
            return list(model.step())
        except MODEL_FAILURES as exc:
            log.exception("%s: a step failed; its sequences end with the error", name)
            self._alone.pop(name, None)
            error = f"the model failed while generating: {error_text(exc)}"
            try:
                return list(model.abort(error))
            except MODEL_FAILURES:
                self._break(name, f"a failed step it could not undo ({error})")
                return []

    def _break(self, name: str, why: str) -> None:
        """``name`` serves nothing more until the worker restarts; the next ``_step`` ends its items."""
        log.exception("%s stopped serving after %s", name, why)
        self._broken[name] = f"{name} stopped serving after {why}"
        self._alone.pop(name, None)

    def _fits(self, stepping: Stepping, item: Item) -> bool:
        alone = item.ref.alone(item.index)
        return (not alone or stepping.model.running() == 0) and stepping.model.can_admit(item.length)

    def _admit(self, stepping: Stepping, item: Item, write: ResultsToStore) -> None:
        """Admit ``item`` to the step model, unless a hook drops it (its error goes to ``write``)."""
        pack: Pack = item.ref
        run: list[Run] = [(pack, (item,))]
        _, dropped = self.hooks.before_batch(run)
        if dropped:
            _store_dropped(dropped, run, write)
            return
        if pack.alone(item.index):
            self._alone[stepping.name] = item
        try:
            stepping.model.admit(item, pack.payload(item.index))
        except MODEL_FAILURES as exc:  # it left the scheduler: ending it here is the only way it ends
            log.exception("%s could not admit an item", stepping.name)
            error = f"the model could not admit the item: {error_text(exc)}"
            self._end(stepping.name, item, FinishedSequence(item, error=error), write)
            return
        self._admitted.setdefault(stepping.name, {})[item.job_id, item.index] = item

    def _report_tokens(self, stepping: Stepping) -> None:
        """Every ``tokens_report_s``, the token counts of the running sequences (all of them: a running
        sequence gains a token every step, so nearly every count has changed since the last report).

        A report names only sequences still running and is queued behind the results of earlier steps;
        one that reaches the store after its item's result anyway (a redelivered item run twice) cannot
        change the count stored with the result.
        """
        now = self.clock()
        name, model = stepping
        if now - self._tokens_reported.get(name, float("-inf")) < self.tokens_report_s:
            return
        self._tokens_reported[name] = now
        counts = [TokenCount(item.job_id, item.index, tokens) for item, tokens in model.progress()]
        if counts:
            self.results.put(TokenReport(counts))


def _runs(items: tuple[Item, ...]) -> list[Run]:
    """The batch's items as runs of one message each: (its pack, its items in the batch)."""
    runs: list[Run] = []
    start = 0
    for pack, run in groupby(items, key=_REF):  # a Pack compares by identity (eq=False)
        end = start + len(list(run))
        runs.append((pack, items[start:end]))
        start = end
    return runs


def _store_dropped(dropped: dict[Pack, str], runs: list[Run], write: ResultsToStore) -> None:
    """The items of these messages end with their message's error, unrun: hooks dropped them (cancelled,
    expired), or their batch failed outside the model."""
    for pack, mine in runs:
        error = dropped.get(pack)
        if error is not None:
            for item in mine:
                write.add(
                    ItemRecord(item.job_id, item.index, pack.item_id(item.index), error=error), pack.delivery
                )


_INDEX = attrgetter("index")
_REF = attrgetter("ref")
