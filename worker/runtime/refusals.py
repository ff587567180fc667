"""Messages that are not a valid call: each fails its own job (never another), and is acknowledged.

A message carries what it likes, and its refusal repeats some of it; nothing in it may stop the store
thread, so a refusal the database will not keep is kept in a plainer form, or let go.
"""

from __future__ import annotations

import logging

from worker.calls import job_id_of
from worker.errors import InvalidInput
from worker.runtime.deliveries import Delivery, Holdings, Refusal
from worker.runtime.forward import error_text
from worker.runtime.outbox import Outbox, Settled
from worker.store.db import is_transient
from worker.store.ports import WorkerStore
from worker.store.values import JobSpec

log = logging.getLogger(__name__)


class Refusals:
    """Used by the store thread; a transient failure (the database down) is raised for it to retry."""

    def __init__(self, store: WorkerStore, outbox: Outbox, holdings: Holdings) -> None:
        self.store = store
        self.outbox = outbox
        self.holdings = holdings

    def refuse(self, refusal: Refusal) -> None:
        """A message that is not a valid call: its own job (if it names one that does not exist yet) fails."""
        delivery = refusal.delivery
        log.warning("message %s refused: %s", delivery.task_id[:80], refusal.error)
        spec = _refused_job(delivery)
        if spec is not None:
            self._fail_new_job(spec, refusal.error, delivery.task_id)
        self.holdings.acknowledged([delivery])
        self.outbox.settle(Settled([delivery]))

    def _fail_new_job(self, spec: JobSpec, error: str, task_id: str) -> None:
        """Record the refused message's job as failed. A message carries what it likes, and the refusal
        repeats it: if the database refuses that text (a NUL byte, say), the job is recorded with the text
        escaped and the model unnamed; if not even that, it is let go. Its message is acknowledged anyway."""
        plain = JobSpec(spec.job_id, "?", spec.priority, spec.total)
        for job, text in ((spec, error), (plain, _escaped(error))):
            try:
                if not self.store.fail_new_job(job, text):
                    log.warning(
                        "job %s already exists: the refused message %s leaves it alone", job.job_id, task_id
                    )
                return
            except Exception as exc:
                if is_transient(exc):
                    raise
                failure = exc
        log.error("the refused message %s left no trace in the store: %s", task_id[:80], error_text(failure))


def _refused_job(delivery: Delivery) -> JobSpec | None:
    """The job a refused message stands for: the job id it names, else its task id, if either is a job id."""
    try:
        kwargs = delivery.message.decode()[1]
    except Exception:
        kwargs = {}
    kwargs = kwargs if isinstance(kwargs, dict) else {}
    model = kwargs.get("model")
    model = model[:200] if isinstance(model, str) else "?"
    for candidate in (kwargs.get("job_id"), delivery.task_id):
        try:
            return JobSpec(job_id_of(candidate), model, "normal", 0)
        except InvalidInput:
            continue
    return None


def _escaped(text: str) -> str:
    """``text`` in printable ASCII, control and non-ASCII characters as escapes: any database keeps it."""
    return text.encode("unicode_escape").decode("ascii")[:2000]
