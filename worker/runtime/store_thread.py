"""The store thread: commit outcomes in one transaction per group of batches, then hand what is complete to
the outbox for acknowledging.

Nothing is acknowledged that is not committed. A failure that waiting cures (the database down) is retried
with backoff; any other is this data's fault: the write is split, as forward.run_batch splits a failing
batch, until the items the database refuses are found. Each of those is stored as an error instead (or, if
even that is refused, logged and let go), the rest are stored, and every message is acknowledged: nothing a
message carries can stop this thread. It never runs models or touches the scheduler.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from functools import partial

from worker.runtime.deliveries import Delivery, Holdings, Refusal, ResultsToStore, StoreWork, TokenReport
from worker.runtime.hooks import Hooks
from worker.runtime.outbox import Outbox, Settled
from worker.runtime.refusals import Refusals
from worker.store.db import is_transient, refused_text
from worker.store.ports import WorkerStore
from worker.store.values import ItemRecord, JobSpec

log = logging.getLogger(__name__)

MAX_GROUP = 64  # writes committed in one transaction at most
MAX_BACKOFF_S = 5.0


class Stopping(Exception):
    """The worker is stopping while the database refuses writes: what is not stored stays unacknowledged."""


class Storer:
    def __init__(
        self, store: WorkerStore, outbox: Outbox, holdings: Holdings, hooks: Hooks | None = None
    ) -> None:
        self.store = store
        self.outbox = outbox
        self.holdings = holdings
        self.hooks = Hooks() if hooks is None else hooks
        self.refusals = Refusals(store, outbox, holdings)
        self.work: queue.SimpleQueue[StoreWork | None] = queue.SimpleQueue()
        self._failing_since: float | None = None
        self._stopping = threading.Event()
        self._settling = threading.Lock()  # the writers count their outcomes off shared deliveries
        # Writer threads: the store says how many it takes at once (a SQLite file takes one writer).
        self.writers = max(1, getattr(store, "concurrent_writers", 1))

    def put(self, work: StoreWork) -> None:
        """Queue ``work`` for the writers; its items have run (or will not) and no longer wait."""
        if isinstance(work, ResultsToStore):
            self.holdings.handed(work.runs)
        self.work.put(work)

    def stalled_s(self) -> float:
        """How long every write has failed for (0 while the store makes progress)."""
        since = self._failing_since
        return 0.0 if since is None else time.monotonic() - since

    def stop(self) -> None:
        """Stop retrying: a store that cannot write gives up, leaving its messages for another worker."""
        self._stopping.set()
        self.work.put(None)

    def loop(self) -> None:
        """The thread's body; a None on ``work`` ends it once everything before it is stored.

        A store that takes concurrent writers (``writers``: PostgreSQL) gets a second writer thread beside
        this one, each on its own connection, so that one group's statements run on the server while the
        next group is sent; settling is one at a time (``_settle``). Measured on a busy 2-core box: see
        bench/README.md, "The store's two writers"."""
        helpers = [
            threading.Thread(target=self._write, name=f"batchwork-store-{number}", daemon=True)
            for number in range(2, self.writers + 1)
        ]
        for helper in helpers:
            helper.start()
        self._write()
        for helper in helpers:
            helper.join()

    def _write(self) -> None:
        """One writer: groups off ``work`` until the None, which it leaves there for the next writer."""
        try:
            while (first := self.work.get()) is not None:
                group, last = self._queued_with(first)
                try:
                    self._store_each(group) if len(group) > 1 else self._store(group)
                except Stopping:
                    log.warning(
                        "stopping with %d writes not stored; their messages go back to the queue", len(group)
                    )
                    return
                except Exception:  # a bug of ours: say so loudly, and keep storing what comes next
                    log.exception("could not store %d writes", len(group))
                if last:
                    return
        finally:
            self.work.put(None)

    def _store_each(self, group: list[StoreWork]) -> None:
        """Store ``group`` in one go; should that hit a bug of ours, store its parts one by one, so that the
        bug holds back only the messages of the part that meets it."""
        try:
            self._store(group)
        except Exception as exc:
            if isinstance(exc, Stopping):
                raise
            log.exception("could not store %d writes together; storing them one by one", len(group))
            for work in group:
                try:
                    self._store([work])
                except Stopping:
                    raise
                except Exception:
                    log.exception("could not store a %s", type(work).__name__)

    def _queued_with(self, first: StoreWork) -> tuple[list[StoreWork], bool]:
        """``first`` and the work queued behind it (small batches pay one commit); True if the end."""
        group = [first]
        while len(group) < MAX_GROUP:
            try:
                work = self.work.get_nowait()
            except queue.Empty:
                return group, False
            if work is None:
                return group, True
            group.append(work)
        return group, False

    def _store(self, group: list[StoreWork]) -> None:
        reports = [w for w in group if isinstance(w, TokenReport)]
        if reports:
            self._record_tokens(reports)
        for refusal in (w for w in group if isinstance(w, Refusal)):
            self._retrying(partial(self.refusals.refuse, refusal))
            self.hooks.settled([refusal.delivery], refusal.error)
        writes = [w for w in group if isinstance(w, ResultsToStore)]
        if writes:
            self._retrying(partial(self._commit, writes))

    def _retrying(self, attempt: Callable[[], None]) -> None:
        """Run ``attempt`` until it sticks; only failures that waiting cures are retried."""
        delay_s = 0.1
        while True:
            try:
                attempt()
                self._failing_since = None
                return
            except Exception as exc:
                if not is_transient(exc):
                    raise
                if self._failing_since is None:
                    self._failing_since = time.monotonic()
                if self._stopping.is_set():
                    raise Stopping from exc
                log.warning("storing failed (%s); retrying in %.1f s", refused_text(exc), delay_s)
                self._stopping.wait(delay_s)
                delay_s = min(delay_s * 2, MAX_BACKOFF_S)

    def _commit(self, writes: list[ResultsToStore]) -> None:
        jobs = [w.jobs for w in writes]  # one job per item for single-item calls: made once
        try:
            stored = self.store.write_batches(
                [(w.record, w.columns, j) for w, j in zip(writes, jobs, strict=True)]
            )
        except Exception as exc:
            if is_transient(exc):
                raise
            log.error(
                "storing %d batches failed (%s); finding the outcomes the database refuses",
                len(writes),
                refused_text(exc),
            )
            for write in writes:
                self._isolate(write)
            return
        _note_redelivered(sum(stored.new_rows), sum(len(w) for w in writes))
        _note_refused(stored.refused_jobs)
        for write, specs in zip(writes, jobs, strict=True):
            self._settle(write, sorted(stored.new_jobs & {spec.job_id for spec in specs}))

    def _isolate(self, write: ResultsToStore) -> None:
        """Store what the database takes of ``write``, halving until the refused outcomes are found."""
        self._store_part(write, write.outcomes, with_record=True)
        self._settle(write, [])

    def _store_part(
        self, write: ResultsToStore, outcomes: Sequence[ItemRecord], *, with_record: bool
    ) -> None:
        jobs = _jobs_of(write, outcomes)
        try:
            self.store.write_batch(write.record if with_record else None, outcomes, jobs)
            return
        except Exception as exc:
            if is_transient(exc):
                raise
            error = exc
        if len(outcomes) > 1:
            middle = len(outcomes) // 2
            self._store_part(write, outcomes[:middle], with_record=with_record)
            self._store_part(write, outcomes[middle:], with_record=False)
            return
        self._store_refused(outcomes[0], jobs, with_record, error)

    def _store_refused(
        self, outcome: ItemRecord, jobs: list[JobSpec], with_record: bool, error: Exception
    ) -> None:
        reason = f"could not store the output: {refused_text(error)}"
        # Last, the reason alone: the item's own error text may be what was refused (a NUL it repeats).
        bare = ItemRecord(outcome.job_id, outcome.index, None, error=reason)
        attempts = [outcome.as_error(reason), outcome.as_error(reason, keep_id=False), bare]
        if with_record:
            attempts.insert(0, outcome)  # the batch record may have been what was refused
        for attempt in attempts:
            try:
                self.store.write_batch(None, [attempt], jobs)
                if attempt is not outcome:
                    log.error("job %s item %d: stored as an error: %s", outcome.job_id, outcome.index, reason)
                return
            except Exception as exc:
                if is_transient(exc):
                    raise
        log.error(
            "job %s item %d cannot be stored at all (%s); let go", outcome.job_id[:40], outcome.index, reason
        )

    def _record_tokens(self, reports: list[TokenReport]) -> None:
        """Running items' token counts, once; best effort, never retried: the next report (about a second
        later) says the same and more, and a result must not wait for one."""
        counts = [count for report in reports for count in report.counts]
        try:
            self.store.record_tokens(counts)
        except Exception as exc:
            log.warning("could not record the token counts of %d running items: %s", len(counts), exc)

    def _settle(self, write: ResultsToStore, new_jobs: list[str]) -> None:
        """Count the stored outcomes off their deliveries, a run (one message's consecutive outcomes) at a
        time; acknowledge the deliveries that owe nothing more. One writer at a time: a message's items may
        be stored by both."""
        with self._settling:
            self._settle_alone(write, new_jobs)

    def _settle_alone(self, write: ResultsToStore, new_jobs: list[str]) -> None:
        self.hooks.after_store(write)
        done: list[Delivery] = []
        released: Counter[JobSpec] = Counter()
        errors, start = write.columns.errors, 0
        for delivery, count in write.runs:
            delivery.pending -= count
            released[delivery.job] += count
            delivery.failed += count - errors[start : start + count].count(None)
            if delivery.pending == 0:
                done.append(delivery)
            start += count
        for job, count in released.items():
            self.holdings.hold(job, -count)
        if done or new_jobs:
            self.holdings.acknowledged(done)
            self.outbox.settle(Settled(done, new_jobs))
        if done:
            self.hooks.settled(done)


def _jobs_of(write: ResultsToStore, outcomes: Sequence[ItemRecord]) -> list[JobSpec]:
    ids = {outcome.job_id for outcome in outcomes}
    return [spec for spec in write.jobs if spec.job_id in ids]


def _note_redelivered(stored: int, outcomes: int) -> None:
    if stored < outcomes:
        # Redelivered messages: first writer wins, nothing is counted twice.
        log.info("%d of %d outcomes were already stored", outcomes - stored, outcomes)


def _note_refused(jobs: frozenset[str]) -> None:
    for job_id in sorted(jobs):
        log.warning(
            "outcomes for job %s not stored: their message names another model or total than the job", job_id
        )
