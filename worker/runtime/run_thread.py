"""The run thread: take the next batch when the model is free and run it, or, for a model driven step by step,
admit waiting items and run one step; hand every outcome to the store thread.

It owns the device and waits on nothing else: cancellations come from the watch thread as a set, results
leave through the storer's queue, task events through the outbox. The one exception is the journal of
suspect items (items of a message whose worker died), written before they run: rare, and it must be durable
before a crash it may witness.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime
from itertools import groupby
from operator import attrgetter

from worker.batching.scheduler import Batch, Item
from worker.runtime import metrics
from worker.runtime.deliveries import Delivery, Outcomes, Pack, TokenReport
from worker.runtime.forward import run_batch
from worker.runtime.loaded_models import Stepping
from worker.runtime.shared import Shared
from worker.runtime.watch import CancelWatch
from worker.store.values import BatchRecord, ItemOutcome, TokenCount

log = logging.getLogger(__name__)

Work = Batch | Stepping


class Runner:
    def __init__(
        self,
        shared: Shared,
        cancels: CancelWatch,
        worker_name: str,
        ran_out_of_memory: Callable[[str, int], None] = lambda model, size: None,
    ) -> None:
        self.settings, self.models, self.scheduler = shared.settings, shared.models, shared.scheduler
        self.ready = shared.ready  # guards the scheduler; the intake notifies it when items arrive
        self.storer, self.outbox = shared.storer, shared.outbox
        self.journal, self.clock = shared.journal, shared.clock
        self.cancels = cancels
        self.worker_name = worker_name
        self.ran_out_of_memory = ran_out_of_memory  # records the size that failed, off this thread
        self._stopping = False
        self._tokens_reported: dict[str, float] = {}  # model name -> when its token counts were last sent
        self._alone: dict[str, Item] = {}  # model name -> the isolated sequence running by itself

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
                        self.storer.work.put(self._run(unit))
                    else:
                        self._step(unit)
                except Exception:  # the runner isolates model errors; this is a bug of ours
                    log.exception("running %s failed", unit)

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

    def _run(self, batch: Batch) -> Outcomes:
        write = Outcomes()
        batch = self._screen(batch, write)
        if not batch.items:
            return write
        runs = _runs(batch.items)
        for pack, _, _ in runs:
            self._mark_started(pack.delivery)
        suspects = [item for pack, lo, hi in runs if pack.suspect for item in batch.items[lo:hi]]
        self._journal(suspects, starting=True)
        started_at, started = datetime.now(UTC), self.clock()
        model = self.models.loaded(batch.model)
        # Per message, not per item: each run's job indices once, its payloads and ids looked up a column at
        # a time.
        indices = [list(map(_INDEX, batch.items[lo:hi])) for _, lo, hi in runs]
        payloads = [
            p for (pack, _, _), mine in zip(runs, indices, strict=True) for p in pack.payloads_of(mine)
        ]
        report = run_batch(model.forward, payloads, model.release_memory)
        run_ms = (self.clock() - started) * 1000
        self._journal(suspects, starting=False)
        with self.ready:
            changed, cap = self.scheduler.batch_ran(batch, report.out_of_memory_at, report.largest_ok)
        if changed:
            log.warning("%s: batches now hold at most %s items", batch.model, cap or "N")
        if report.out_of_memory_at is not None:
            self.ran_out_of_memory(batch.model, report.out_of_memory_at)
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
        metrics.batch_ran(write.record, report)
        for (pack, lo, hi), mine in zip(runs, indices, strict=True):
            write.extend(pack.delivery, mine, pack.ids_of(mine), report.outputs[lo:hi], report.errors[lo:hi])
        log.info(
            "batch %s/%s: %d items, tokens %d real / %d padded, oldest waited %.1f ms, ran %.1f ms",
            *(batch.model, batch.lane[1], len(batch.items), batch.real_tokens, batch.padded_tokens),
            *(batch.oldest_wait_s * 1000, run_ms),
        )
        return write

    def _screen(self, batch: Batch, write: Outcomes) -> Batch:
        """The batch without items of cancelled jobs or past their job's deadline; those end as errors.
        Decided once per message, not per item: cancellation and deadlines are the job's."""
        dropped = {
            pack: error
            for pack, _, _ in _runs(batch.items)
            if (error := self._why_dropped(pack.delivery)) is not None
        }
        if not dropped:
            return batch
        live = []
        for item in batch.items:
            error = dropped.get(item.ref)
            if error is None:
                live.append(item)
            else:
                pack: Pack = item.ref
                write.add(
                    ItemOutcome(item.job_id, item.index, pack.item_id(item.index), error=error), pack.delivery
                )
        return Batch(batch.lane, tuple(live), batch.formed_at)

    def _why_dropped(self, delivery: Delivery) -> str | None:
        """Why items of this message must not run (its job was cancelled or its deadline passed), if so."""
        call = delivery.call
        assert call is not None
        if call.job_id in self.cancels.cancelled:
            return "cancelled"
        if call.expires_at is not None and time.time() > call.expires_at:
            return "expired: not started before the job's deadline"
        return None

    def _dropped(self, item: Item, write: Outcomes) -> bool:
        """Store why ``item`` must not run (its job was cancelled or its deadline passed), if so."""
        pack: Pack = item.ref
        error = self._why_dropped(pack.delivery)
        if error is None:
            return False
        write.add(ItemOutcome(item.job_id, item.index, pack.item_id(item.index), error=error), pack.delivery)
        return True

    def _journal(self, suspects: list[Item], *, starting: bool) -> None:
        """Count a death for suspects about to run (``starting``), or take it back once they returned."""
        if not suspects or self.journal is None:
            return
        items = [(item.job_id, item.index) for item in suspects]
        try:
            (self.journal.starting if starting else self.journal.finished)(items)
        except Exception as exc:  # run anyway: a missed count only delays the cap by one delivery
            log.warning("could not journal %d suspect items: %s", len(suspects), exc)

    def _mark_started(self, delivery: Delivery) -> None:
        if not delivery.started:
            delivery.started = True
            self.outbox.event("task-started", delivery)

    # -- steps (continuous batching) ------------------------------------------------------------

    def _has_steps(self, stepping: Stepping) -> bool:
        return stepping.model.running() > 0 or self.scheduler.waiting_for(stepping.name) > 0

    def _step(self, stepping: Stepping) -> None:
        """Continuous batching: admit waiting items while there is room, then advance every sequence."""
        name, model = stepping
        write, now = Outcomes(), self.clock()
        while model.running() < model.max_running and name not in self._alone:
            with self.ready:
                item = self.scheduler.admit_next(name, now, lambda item: self._fits(stepping, item))
            if item is None:
                break
            if not self._dropped(item, write):
                self._admit(stepping, item)
        for finished in model.step():
            key: Item = finished.key
            pack: Pack = key.ref
            if self._alone.get(name) is key:
                del self._alone[name]
            if pack.suspect:
                self._journal([key], starting=False)
            outcome = ItemOutcome(
                key.job_id,
                key.index,
                pack.item_id(key.index),
                finished.output,
                finished.error,
                finished.tokens,
            )
            write.add(outcome, pack.delivery)
        if len(write):
            self.storer.work.put(write)
        self._report_tokens(stepping)

    def _fits(self, stepping: Stepping, item: Item) -> bool:
        alone = item.ref.alone(item.index)
        return (not alone or stepping.model.running() == 0) and stepping.model.can_admit(item.length)

    def _admit(self, stepping: Stepping, item: Item) -> None:
        pack: Pack = item.ref
        self._mark_started(pack.delivery)
        if pack.suspect:
            self._journal([item], starting=True)
        if pack.alone(item.index):
            self._alone[stepping.name] = item
        stepping.model.admit(item, pack.payload(item.index))

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
            self.storer.work.put(TokenReport(counts))


def _runs(items: tuple[Item, ...]) -> list[tuple[Pack, int, int]]:
    """The batch's items as runs of one message each: (its pack, first position, end position)."""
    runs: list[tuple[Pack, int, int]] = []
    start = 0
    for pack, run in groupby(items, key=_REF):  # a Pack compares by identity (eq=False)
        end = start + len(list(run))
        runs.append((pack, start, end))
        start = end
    return runs


_INDEX = attrgetter("index")
_REF = attrgetter("ref")
