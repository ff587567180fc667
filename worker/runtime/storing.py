"""The store thread: commit each write in one transaction, then acknowledge what is complete.

Nothing is acknowledged that is not committed: a database that is down is waited for, with
backoff. It must never run models or touch the scheduler.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from datetime import UTC, datetime
from typing import Any

from worker.runtime import metrics
from worker.runtime.deliveries import Acks, Delivery, Holdings, Message, TaskEvents, Write
from worker.runtime.runner import describe
from worker.store.db import is_transient
from worker.store.results import ItemOutcome, JobSpec, ResultStore

log = logging.getLogger(__name__)

MAX_GROUP = 64  # writes committed in one transaction at most


class Storer:
    def __init__(self, store: ResultStore, acks: Acks, events: TaskEvents, holdings: Holdings) -> None:
        self.store = store
        self.acks = acks
        self.events = events
        self.holdings = holdings
        self.writes: queue.SimpleQueue[Write | None] = queue.SimpleQueue()

    def loop(self) -> None:
        """The thread's body; a None on ``writes`` ends it once everything before it is stored."""
        while (write := self.writes.get()) is not None:
            group, last = self._waiting_with(write)
            self._commit_group(group)
            for each in group:
                self._settle(each)
            if last:
                return

    def _waiting_with(self, first: Write) -> tuple[list[Write], bool]:
        """``first`` and the writes queued behind it (small batches pay one commit); True if the end."""
        group = [first]
        while len(group) < MAX_GROUP:
            try:
                write = self.writes.get_nowait()
            except queue.Empty:
                return group, False
            if write is None:
                return group, True
            group.append(write)
        return group, False

    def _commit_group(self, group: list[Write]) -> None:
        reports = [w for w in group if w.tokens]
        if reports:
            self._record_tokens(reports)
            group = [w for w in group if not w.tokens]
        batches = [w for w in group if w.outcomes]
        if len(batches) > 1:
            try:
                stored = self.store.write_batches([(w.record, w.outcomes, w.jobs) for w in batches])
                self._note_redelivered(sum(stored), sum(len(w.outcomes) for w in batches))
                group = [w for w in group if not w.outcomes]
            except Exception as exc:
                log.warning(
                    "storing %d batches together failed (%s); storing them one by one", len(batches), exc
                )
        for write in group:
            self._commit(write)

    def _record_tokens(self, reports: list[Write]) -> None:
        """Running items' token counts, the newest of each, once; best effort, never retried: the next
        report (about a second later) says the same and more, and a result must not wait for one."""
        counts = [count for report in reports for count in report.tokens]
        try:
            self.store.record_tokens(counts)
        except Exception as exc:
            log.warning("could not record the token counts of %d running items: %s", len(counts), exc)

    def _commit(self, write: Write) -> None:
        """Store until it sticks: nothing is acknowledged that is not committed.

        A database that is down is waited for. Anything else (an output the database refuses) is a
        permanent failure of those outputs: they are stored as errors instead, so the items still end.
        """
        delay_s = 0.1
        while True:
            try:
                self._write(write)
                return
            except Exception as exc:
                if not is_transient(exc) and write.outcomes and not write.degraded:
                    log.error(
                        "storing %d outcomes failed (%s); storing them as errors", len(write.outcomes), exc
                    )
                    write.outcomes = [
                        _as_error(o, f"could not store the output: {describe(exc)}") for o in write.outcomes
                    ]
                    write.degraded = True
                    continue
                log.warning(
                    "storing %d outcomes failed (%s); retrying in %.1f s", len(write.outcomes), exc, delay_s
                )
                time.sleep(delay_s)
                delay_s = min(delay_s * 2, 5.0)

    def _write(self, write: Write) -> None:
        if write.record is None and not write.outcomes:
            self._store_refusal(write.deliveries[0])
        else:
            stored = self.store.write_batch(write.record, write.outcomes, write.jobs)
            self._note_redelivered(stored, len(write.outcomes))

    @staticmethod
    def _note_redelivered(stored: int, outcomes: int) -> None:
        if stored < outcomes:
            # Redelivered messages: first writer wins, nothing is counted twice.
            log.info("%d of %d outcomes were already stored", outcomes - stored, outcomes)

    def _store_refusal(self, delivery: Delivery) -> None:
        kwargs = _safe_kwargs(delivery.message)
        job_id = str(kwargs.get("job_id") or delivery.task_id)
        model = kwargs.get("model")
        model = model if isinstance(model, str) else "?"
        self.store.create_job(JobSpec(job_id, model, "normal", 0))
        self.store.fail_job(job_id, delivery.error or "invalid message")

    def _settle(self, write: Write) -> None:
        metrics.items_stored(write)
        done: list[Delivery] = []
        released: Counter[JobSpec] = Counter()
        for delivery, outcome in zip(write.deliveries, write.outcomes, strict=False):
            delivery.pending -= 1
            released[delivery.job] += 1
            delivery.failed += outcome.error is not None
            if delivery.pending == 0:
                done.append(delivery)
        if not write.outcomes:
            done = write.deliveries
        for job, count in released.items():
            self.holdings.hold(job, -count)
        if done:
            self.holdings.acknowledged(done)
            self.acks.ack([d.message for d in done])
            for delivery in done:
                self.events.finished(delivery)

    def broker_lost_messages(self, grace_s: float) -> None:
        """The broker came back empty (restarted without persistence): what it held is gone.

        After a grace period, in which workers finish and store the items they already hold, every
        item of a job created before now that still has no outcome ends with a "lost" error, so no
        job waits forever for messages that no longer exist.
        """
        cutoff = datetime.now(UTC)
        log.warning("the broker lost its messages; unfinished items end as lost in %.0f s", grace_s)
        timer = threading.Timer(grace_s, self._end_lost_items, args=(cutoff,))
        timer.daemon = True
        timer.start()

    def _end_lost_items(self, cutoff: datetime) -> None:
        error = "lost: the broker restarted and dropped this item before it ran; submit it again"
        for attempt in range(10):
            try:
                for job in self.store.unfinished_jobs(created_before=cutoff):
                    missing = self.store.missing_indices(job.job_id, job.total)
                    outcomes = [ItemOutcome(job.job_id, index, None, error=error) for index in missing]
                    if outcomes:
                        self.store.write_batch(None, outcomes, [job])
                        log.warning("job %s: %d items ended as lost", job.job_id, len(outcomes))
                return
            except Exception as exc:
                log.warning("could not end lost items (%s); attempt %d", exc, attempt + 1)
                time.sleep(5)


def _as_error(outcome: ItemOutcome, error: str) -> ItemOutcome:
    if outcome.error is not None:
        return outcome
    return ItemOutcome(outcome.job_id, outcome.index, outcome.item_id, error=error)


def _safe_kwargs(message: Message) -> dict[str, Any]:
    try:
        kwargs = message.decode()[1]
    except Exception:
        return {}
    return kwargs if isinstance(kwargs, dict) else {}
