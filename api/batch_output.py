"""A batch's output and error files, written in input order while its jobs run, resumable after a crash.

Each model's results are read from the store by item index; the lines whose every input has a stored
outcome (the next ones in input order, without a gap) are answered and appended as one chunk row per file,
and the cursor that covers those bytes (``Cursor``: the next line, each model's next item, each file's
next chunk and size, the lines counted completed and failed) is committed in the same transaction, under
the batch's lease. A process that dies mid-way leaves bytes and cursor as they were; the next one to take
the batch goes on from there, so every line is written exactly once. The final pass answers the rest,
an input without an outcome failing with the reason given (cancelled, expired).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any

from worker.openai_compat.batchfile import BatchLine, BatchPlan, Counter, answer_range
from worker.openai_compat.responses import RawJson
from worker.store import outputs
from worker.store.db import client_errors
from worker.store.files import CHUNK_BYTES, BatchStore, FileStore

APPEND_LINES = 10_000  # lines answered and committed per transaction at most
APPEND_ITEMS = 10_000  # inputs read per transaction at most (lines of many inputs), and probed per job
MIN_APPEND_LINES = 1000  # while the jobs run, fewer lines than this wait for more ...
MIN_APPEND_EVERY_S = 1.0  # ... unless this long has passed since this batch's last append here
RESULTS_PAGE = 5000  # items whose outcomes are read per query
APPEND_BYTES = 32 * 2**20  # bytes answered per transaction at most (MiniLM's lines are ~8 KB each)
STEP_APPENDS = 4  # appends per step while the jobs run, so that one large batch never holds up the others


class LeaseLost(Exception):
    """Another process took the batch over (our lease ran out): it writes from the stored cursor."""


@dataclass
class Cursor:
    """How far a batch's files are written (stored as ``openai_batches.written``)."""

    line: int = 0  # position in the plan's lines of the next line to answer
    items: dict[str, int] = field(default_factory=dict)  # model -> its next item index
    output_seq: int = 0
    output_bytes: int = 0
    error_seq: int = 0
    error_bytes: int = 0
    completed: int = 0  # lines in the output file
    failed: int = 0  # lines in the error file

    @classmethod
    def of(cls, row: dict[str, Any]) -> Cursor:
        """The batch row's cursor (a fresh one before anything is written)."""
        written = row.get("written") or {}
        stored = {name: written[name] for name in _STORED if name in written}
        return cls(**stored, completed=row.get("completed") or 0, failed=row.get("failed") or 0)

    def stored(self) -> dict[str, Any]:
        """The cursor as ``openai_batches.written`` keeps it (the counts have columns of their own)."""
        return {name: getattr(self, name) for name in _STORED}


_STORED = ("line", "items", "output_seq", "output_bytes", "error_seq", "error_bytes")


class OutputWriter:
    """Appends a batch's answered lines to its output and error files (ids given), a transaction at a time."""

    def __init__(self, files: FileStore, batches: BatchStore, owner: str, lease_s: float) -> None:
        self.files = files
        self.batches = batches
        self.owner = owner
        self.lease_s = lease_s
        self._appended_at: dict[str, float] = {}

    def write(
        self,
        row: dict[str, Any],
        plan: BatchPlan,
        files: tuple[str, str],
        cursor: Cursor,
        count_tokens: Counter | None,
        missing: str | None = None,
    ) -> Cursor:
        """Append what can be answered now and return the new cursor. ``missing`` None: only lines whose
        inputs all have stored outcomes, in input order up to the first that has not; otherwise every line
        left, an input without an outcome failing with ``missing``. LeaseLost if the batch was taken over."""
        jobs: dict[str, str] = row["jobs"] or {}
        appends = 0
        while cursor.line < len(plan.lines) and (missing is not None or appends < STEP_APPENDS):
            appends += 1
            if missing is None:
                stop = self._ready(plan, cursor, jobs, row["id"])
            else:
                stop = _bounded(plan, cursor, len(plan.lines))
            if stop == cursor.line:
                break
            cursor = self._append(row, plan.lines[cursor.line : stop], files, cursor, count_tokens, missing)
        return cursor

    # -- which lines are ready ---------------------------------------------------------------------

    def _ready(self, plan: BatchPlan, cursor: Cursor, jobs: dict[str, str], batch_id: str) -> int:
        """The end of the lines (from the cursor) whose inputs are all stored; the cursor's own line when
        there are too few yet to be worth a transaction."""
        stored = {
            model: self._stored_through(job_id, cursor.items.get(model, 0)) for model, job_id in jobs.items()
        }
        stop = _bounded(plan, cursor, len(plan.lines), stored)
        waited = time.monotonic() - self._appended_at.get(batch_id, 0.0)
        if stop - cursor.line < MIN_APPEND_LINES and stop < len(plan.lines) and waited < MIN_APPEND_EVERY_S:
            return cursor.line
        return stop

    def _stored_through(self, job_id: str, start: int) -> int:
        """The item index after the run of stored outcomes from ``start`` (``start`` if it has none)."""
        with client_errors(self.files.url):
            return outputs.stored_through(self.files.engine, job_id, start, APPEND_ITEMS)

    # -- one append --------------------------------------------------------------------------------

    def _append(
        self,
        row: dict[str, Any],
        lines: list[BatchLine],
        files: tuple[str, str],
        cursor: Cursor,
        count_tokens: Counter | None,
        missing: str | None,
    ) -> Cursor:
        """Answer ``lines`` (as many as fit in APPEND_BYTES), then commit their bytes and the cursor."""
        jobs: dict[str, str] = row["jobs"] or {}
        ends = {line.request.model: line.first + len(line.request.items) for line in lines}
        outcomes = {
            model: self._outcomes(jobs[model], cursor.items.get(model, 0), end)
            for model, end in ends.items()
            if model in jobs and end > cursor.items.get(model, 0)
        }
        output, errors = bytearray(), bytearray()
        items = dict(cursor.items)
        answers = answer_range(lines, outcomes, row["id"], missing or "no result was stored", count_tokens)
        completed = failed = 0
        for line, answer in zip(lines, answers, strict=False):
            if answer.ok:
                output += answer.line
                completed += 1
            else:
                errors += answer.line
                failed += 1
            items[line.request.model] = line.first + len(line.request.items)
            if len(output) + len(errors) >= APPEND_BYTES:
                break
        out_rows, error_rows = _rows(output), _rows(errors)
        new = Cursor(
            cursor.line + completed + failed,
            items,
            cursor.output_seq + len(out_rows),
            cursor.output_bytes + len(output),
            cursor.error_seq + len(error_rows),
            cursor.error_bytes + len(errors),
            cursor.completed + completed,
            cursor.failed + failed,
        )
        with client_errors(self.files.url), self.files.engine.begin() as conn:
            counts = {"completed": new.completed, "failed": new.failed}
            if not self.batches.record_written(
                conn, row["id"], self.owner, new.stored(), self.lease_s, **counts
            ):
                raise LeaseLost(row["id"])
            for file_id, seq, pieces in (
                (files[0], cursor.output_seq, out_rows),
                (files[1], cursor.error_seq, error_rows),
            ):
                for offset, piece in enumerate(pieces):
                    self.files.append(conn, file_id, seq + offset, piece)
        self._appended_at[row["id"]] = time.monotonic()
        return new

    def _outcomes(self, job_id: str, start: int, stop: int) -> Iterator[tuple[int, Any, str | None]]:
        """The job's stored outcomes of items [start, stop) in index order, outputs as their JSON text
        (RawJson: a float embedding goes into its answer never decoded), a page a query."""
        engine = self.files.engine
        for page in range(start, stop, RESULTS_PAGE):
            end = min(stop, page + RESULTS_PAGE)
            with client_errors(self.files.url):
                texts = outputs.joined_output_texts(engine, job_id, page, end)
                rows = [] if texts is not None else outputs.output_texts(engine, job_id, page, end)
            if texts is not None:
                yield from zip(range(page, end), map(RawJson, texts), repeat(None))
                continue
            for index, output, error in rows:
                yield index, None if output is None else RawJson(output), error

    def forget(self, batch_id: str) -> None:
        self._appended_at.pop(batch_id, None)


def _rows(data: bytearray) -> list[bytes]:
    """``data`` as chunk rows of at most CHUNK_BYTES (a file is served a few rows a query)."""
    return [bytes(data[start : start + CHUNK_BYTES]) for start in range(0, len(data), CHUNK_BYTES)]


def _bounded(plan: BatchPlan, cursor: Cursor, end: int, stored: dict[str, int] | None = None) -> int:
    """The end of the lines from the cursor to take in one append: at most APPEND_LINES lines and (after the
    first) APPEND_ITEMS inputs, and with ``stored``, only lines whose inputs are below their model's mark."""
    stop = cursor.line
    taken = 0
    limit = min(end, cursor.line + APPEND_LINES)
    while stop < limit:
        line = plan.lines[stop]
        count = len(line.request.items)
        if stop > cursor.line and taken + count > APPEND_ITEMS:
            break
        if stored is not None and line.first + count > stored.get(line.request.model, 0):
            break
        taken += count
        stop += 1
    return stop
