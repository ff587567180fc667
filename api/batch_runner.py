"""Advances OpenAI batches, in every API process, one step at a time under a lease in the batch's row:
validating (check the input file, enqueue one job per model) -> in_progress (its jobs run on the workers)
-> finalizing (the rest of the output and error files written from the stored results) -> completed; or failed
(validation), expired (nothing ran before the deadline), cancelling -> cancelled. While the jobs run, the
output and error files are written as results are stored (``api.batch_output``), so finalizing only writes
the last lines and lists the files.

Nothing lives only in this process: the input file, the batch row, the jobs and their results are in SQL,
job ids derive from the batch id and the model, and the output is assembled from stored results. A process
killed mid-step leaves the lease to run out (``LEASE_S``), and the next process to look takes the step again
from its start: a file written twice replaces its chunks, a job registered twice exists once, a message
published twice stores each result once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import uuid
from datetime import datetime, timedelta
from typing import Any

from api.backend import Backend
from api.batch_output import Cursor, LeaseLost, OutputWriter
from api.uploads import CACHED_BYTES, UploadCache, checked_plan
from worker.calls import NewJob
from worker.errors import DatabaseUnavailable, JobNotFound
from worker.models.registry import model_class
from worker.openai_compat.batchfile import BatchPlan, plan_batch
from worker.openai_compat.tokens import count_tokens, detokenize
from worker.store.files import BatchStore, FileRecord, FileStore, utcnow
from worker.store.values import FINISHED_STATES

log = logging.getLogger("batchwork.api.batches")

LEASE_S = 20.0  # a step not renewed for this long is taken over by another process
POLL_S = 0.05  # how often each API process looks for batches to advance (a query per batch and job)
# ... while it found none to advance: a batch made here wakes it at once (``kick``), and another process's
# runner advances the batches that process made; this bounds how long a batch left by a dead process waits.
IDLE_POLL_S = 1.0
BATCH_PRIORITY = "bulk"  # an OpenAI batch is overnight work: it rides the bulk lane
KEPT_PLANS = 8  # batches whose plan this process keeps for writing their output while their jobs run
SWEEP_EVERY_S = 60.0  # how often each API process deletes the files past their expires_at
_JOB_IDS = uuid.UUID("4b0f7a4e-9b1f-4f55-8b1e-6e0f1c8d2a77")
_FILE_IDS = uuid.UUID("0c7f5e2a-1d3b-4a8e-b6f4-2f9d8e7c6b51")


def job_id_for(batch_id: str, model: str) -> str:
    return str(uuid.uuid5(_JOB_IDS, f"{batch_id}\0{model}"))


def file_id_for(batch_id: str, which: str) -> str:
    return "file-" + uuid.uuid5(_FILE_IDS, batch_id + "\0" + which).hex


def unix(moment: datetime | None) -> int | None:
    return None if moment is None else int(moment.timestamp())


class BatchRunner:
    """A thread that advances every batch whose lease is free, every POLL_S while there are some, every
    IDLE_POLL_S while there are none, and at once after a ``kick``."""

    def __init__(self, served: Backend, files: FileStore, batches: BatchStore, uploads: UploadCache) -> None:
        self.served = served
        self.files = files
        self.batches = batches
        self.uploads = uploads
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"[:64]
        # The plan of each batch this process writes the output of (one that takes over a batch, or has
        # forgotten its plan, reads the file again).
        self._plans: dict[str, BatchPlan] = {}
        self.writer = OutputWriter(files, batches, self.owner, LEASE_S)
        self._swept_at = 0.0
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="batchwork-batches", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def kick(self) -> None:
        self._wake.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            open_batches = True  # a failed look is retried soon
            try:
                if time.monotonic() - self._swept_at > SWEEP_EVERY_S:
                    self._swept_at = time.monotonic()
                    self.files.sweep_expired()
                claimable = self.batches.claimable()
                open_batches = bool(claimable)
                for batch_id in claimable:
                    if self._stop.is_set():
                        return
                    self.step(batch_id)
            except DatabaseUnavailable as exc:  # the database away: one line, retried at the next poll
                log.warning("advancing OpenAI batches: %s; retrying", exc)
                self._stop.wait(1.0)
            except Exception:  # a bug in one step: its traceback, retried at the next poll
                log.exception("advancing OpenAI batches failed; retrying")
                self._stop.wait(1.0)
            self._wake.wait(POLL_S if open_batches else IDLE_POLL_S)
            self._wake.clear()

    def step(self, batch_id: str) -> None:
        """Take one step of the batch if no other process holds its lease."""
        row = self.batches.claim(batch_id, self.owner, LEASE_S)
        if row is None:
            return
        try:
            status = row["status"]
            if status == "validating":
                self._validate(row)
            elif status == "in_progress":
                self._progress(row)
            else:  # finalizing or cancelling: write the files from what is stored
                self._finalize(row)
        except LeaseLost:  # another process took the batch over and writes on from the stored cursor
            log.warning("OpenAI batch %s was taken over by another process", batch_id)
        finally:
            self.batches.release(batch_id, self.owner)

    def _renew(self, batch_id: str) -> None:
        self.batches.claim(batch_id, self.owner, LEASE_S)

    # -- validating -------------------------------------------------------------------------------

    def _plan_of(self, row: dict[str, Any]) -> BatchPlan:
        """The batch's plan: kept since its validation here, or its file read again (without the models'
        checks, which it passed)."""
        plan = self._plans.get(row["id"])
        if plan is None:
            plan = self.plan(row, check=False) or BatchPlan()
            self._keep(row["id"], plan)
        return plan

    def _keep(self, batch_id: str, plan: BatchPlan) -> None:
        while len(self._plans) >= KEPT_PLANS:
            self._plans.pop(next(iter(self._plans)))
        self._plans[batch_id] = plan

    def plan(self, row: dict[str, Any], check: bool = True) -> BatchPlan | None:
        """The input file's plan (None if the file is gone): checked as it was uploaded to this process, or
        read back from the store and checked now (a small file whole, in one pass if its lines are plain)."""
        file_id, endpoint, settings = row["input_file_id"], row["endpoint"], self.served.settings
        record = self.files.get(file_id, [row["tenant"]])
        if record is None:
            return None
        plan = self.uploads.plan(file_id, endpoint)
        data = self.uploads.data(file_id)
        self.uploads.drop(file_id)  # used once: the batch keeps its plan (another batch reads the store)
        if plan is not None:
            return plan
        if data is None and record.bytes <= CACHED_BYTES:
            data = b"".join(self.files.content(file_id))
        if data is not None:
            return checked_plan(data, endpoint, settings, check)
        return plan_batch(self.files.lines(file_id), endpoint, settings, detokenize, check)

    def _validate(self, row: dict[str, Any]) -> None:
        batch_id = row["id"]
        plan = self.plan(row)
        if plan is None:
            errors = [{"code": "file_not_found", "message": "the input file was deleted", "line": None}]
            self._fail(row, errors)
            return
        if plan.error_count:
            self._fail(row, [error.as_dict() for error in plan.errors])
            return
        jobs = {model: job_id_for(batch_id, model) for model in plan.items}
        self._keep(batch_id, plan)
        total_items = sum(len(items) for items in plan.items.values())
        if not self.batches.advance(
            batch_id, self.owner, ("validating",), jobs=jobs, total=len(plan.lines), total_items=total_items
        ):
            return  # cancelled meanwhile: the cancelling step finishes it
        expires_at = row["expires_at"].timestamp()
        for model, items in plan.items.items():
            self._renew(batch_id)
            self._enqueue(row, jobs[model], model, items, expires_at)
        self.batches.advance(
            batch_id, self.owner, ("validating",), status="in_progress", in_progress_at=utcnow()
        )

    def _enqueue(
        self, row: dict[str, Any], job_id: str, model: str, items: list[Any], expires_at: float
    ) -> None:
        call = NewJob(job_id, model, items, BATCH_PRIORITY, 0, len(items), expires_at, time.time())
        # A job recorded by an earlier try of this step is left as it is and published again: every
        # item's result is stored once whatever number of times its message runs.
        self.served.jobs.record(call, tenant=row["tenant"], metadata={"openai_batch": row["id"]})
        self.served.jobs.publish(call)

    def _fail(self, row: dict[str, Any], errors: list[dict[str, Any]]) -> None:
        now = utcnow()
        self.batches.advance(
            row["id"], self.owner, ("validating",), status="failed", failed_at=now, errors=errors
        )

    # -- in progress -------------------------------------------------------------------------------

    def job_states(self, row: dict[str, Any]) -> dict[str, Any]:
        """Each job's status (None for a job not recorded yet)."""
        jobs = self.served.jobs
        return {model: jobs.find(job_id) for model, job_id in (row["jobs"] or {}).items()}

    def _progress(self, row: dict[str, Any]) -> None:
        states = self.job_states(row)
        finished = all(s is not None and s.state in FINISHED_STATES for s in states.values())
        if not finished and utcnow() > row["expires_at"] + timedelta(seconds=self._grace_s()):
            # Past the deadline and no worker ended the rest as expired: stop them; the unstored are expired.
            self._cancel_jobs(row)
            finished = True
        if not finished:  # write the lines answered so far
            plan = self._plans.get(row["id"])
            if plan is None and len(self._plans) < KEPT_PLANS:
                # Taken over, or forgotten: read the file again while there is room, never one plan in
                # place of another at every poll (a batch with no plan here writes all at finalizing).
                plan = self._plan_of(row)
            if plan is not None:
                self.writer.write(row, plan, self._file_ids(row), Cursor.of(row), self._counter)
            return
        now = utcnow()
        if self.batches.advance(
            row["id"], self.owner, ("in_progress",), status="finalizing", finalizing_at=now
        ):
            self._finalize({**row, "status": "finalizing", "finalizing_at": now})

    def _cancel_jobs(self, row: dict[str, Any]) -> None:
        for job_id in (row["jobs"] or {}).values():
            with contextlib.suppress(JobNotFound):  # not enqueued yet: nothing of it will run
                self.served.jobs.cancel(job_id)

    def _grace_s(self) -> float:
        return float(self.served.settings.visibility_timeout_s)

    # -- finalizing / cancelling -------------------------------------------------------------------

    def _finalize(self, row: dict[str, Any]) -> None:
        """Write the lines left (an input without an outcome fails as cancelled or expired), then list the
        files and end the batch in one transaction."""
        if row["status"] == "cancelling":
            self._cancel_jobs(row)
        plan = self._plan_of(row) if row["jobs"] else BatchPlan()
        expired = utcnow() > row["expires_at"]
        missing = (
            "cancelled" if row["status"] == "cancelling" else "expired" if expired else "no result was stored"
        )
        cursor = self.writer.write(row, plan, self._file_ids(row), Cursor.of(row), self._counter, missing)
        self._finish(row, cursor, expired)
        self._plans.pop(row["id"], None)
        self.writer.forget(row["id"])

    def _finish(self, row: dict[str, Any], cursor: Cursor, expired: bool) -> None:
        now = utcnow()
        if row["status"] == "cancelling":
            status, stamp = "cancelled", "cancelled_at"
        elif expired and cursor.completed == 0:
            status, stamp = "expired", "expired_at"
        else:
            status, stamp = "completed", "completed_at"
        output_id, error_id = self._file_ids(row)
        ends = None if row["output_expires_s"] is None else now + timedelta(seconds=row["output_expires_s"])
        records = [
            FileRecord(file_id, row["tenant"], f"{row['id']}_{name}.jsonl", "batch_output", size, now, ends)
            for file_id, name, size, used in (
                (output_id, "output", cursor.output_bytes, cursor.completed > 0),
                (error_id, "error", cursor.error_bytes, cursor.failed > 0),
            )
            if used
        ]
        values = {
            "status": status,
            stamp: now,
            "output_file_id": output_id if cursor.completed else None,
            "error_file_id": error_id if cursor.failed else None,
        }
        with self.files.engine.begin() as conn:
            if not self.batches.advance(row["id"], self.owner, (row["status"],), conn=conn, **values):
                return
            for record in records:
                self.files.add(conn, record)

    @staticmethod
    def _file_ids(row: dict[str, Any]) -> tuple[str, str]:
        return file_id_for(row["id"], "output"), file_id_for(row["id"], "errors")

    def _counter(self, model: str, texts: list[str]) -> list[int]:
        return count_tokens(model_class(model, self.served.settings), texts)
