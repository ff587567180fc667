"""``batchwork run`` as streams, in flat memory: the file is read and checked whole first (nothing is enqueued
before every line passed), then published a window at a time while the results are written in input order as
they arrive. Never holds the file, the job or its results whole.

The main thread does every step, each short, so Ctrl-C is seen at once however busy the worker is: the first
cancels the job and stores its unfinished items as cancelled (file and store agree), the second exits at once.
A run killed outright is continued by the same command from its state file beside the output.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import orjson
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text

from worker.bounds import is_count
from worker.cli.base import console
from worker.errors import InvalidInput
from worker.jsonl import InputFileError, ResultFile, format_result, input_lines, parse_line, too_many

# Items published and not yet written, at most: bounds what the in-memory broker, a Redis queue and this
# process hold. Fewer when lines are long: about WINDOW_BYTES of input.
WINDOW_ITEMS = 50_000
WINDOW_BYTES = 32 << 20
# Items checked per client call while the file is read.
CHECK_CHUNK = 2_000
# How long one publish or write step may run before the loop looks at Ctrl-C and the other step again.
STEP_S = 0.05
# How often the results that arrived are read: often enough to write as they come, rarely enough that each
# read takes many rows (a read costs about as much as a thousand rows; the worker's threads want the GIL).
READ_EVERY_S = 0.25
# How often the job's status is read for the progress bar and for a job finished by someone else.
STATUS_EVERY_S = 1.0
# How often the state file records how far publishing got: a resumed run sends again what it sent since
# (a worker stores a result once, however often its item comes): this bounds repeated work, not results.
SAVE_EVERY_S = 1.0
# Output lines past a missing index held while it runs: beyond this, newer results are read once it arrived.
AHEAD_BYTES = 32 << 20


# -- the file, checked ------------------------------------------------------------------------------------


def check_file(client: Any, path: Path, model: str, priority: str, max_items: int) -> Any:
    """The job's header (a NewJob: its fields, no inputs; ``total`` items) once every line of ``path``
    passed the checks; InputFileError naming the line of the first mistake."""
    from worker.calls import NewJob

    head = None
    total = 0
    for lines, items in _chunks(path):
        try:
            call = client.check(model, items, priority)
        except InvalidInput as exc:
            if exc.index is None:
                raise
            raise InputFileError(f"{path}, line {lines[exc.index]}: {exc.detail}") from None
        head = head or call
        total += len(items)
        if total > max_items:
            raise too_many(path, max_items)
    if head is None:
        raise InputFileError(f"{path}: no inputs")
    return NewJob.header(head.job_id, head.model, head.priority, total, head.expires_at, head.created_at)


def _chunks(path: Path) -> Iterator[tuple[list[int], list[Any]]]:
    lines: list[int] = []
    items: list[Any] = []
    for number, line in input_lines(path):
        items.append(parse_line(path, number, line))
        lines.append(number)
        if len(items) >= CHECK_CHUNK:
            yield lines, items
            lines, items = [], []
    if items:
        yield lines, items


# -- where a run stands, for resume ------------------------------------------------------------------------


@dataclass
class RunState:
    """The state file beside the output (``.NAME.run``): which job a run of this input made and how far
    its publishing got. Present only while a run is unfinished; a killed run's successor reads it."""

    path: Path
    fingerprint: str
    job_id: str = ""
    published: int = 0

    @classmethod
    def beside(cls, output: Path, fingerprint: str) -> RunState:
        return cls(output.with_name(f".{output.name}.run"), fingerprint)

    def previous(self) -> RunState | None:
        """The state a killed run of the same input, model and options left, if any."""
        try:
            saved = orjson.loads(self.path.read_bytes())
        except (OSError, orjson.JSONDecodeError):
            return None
        if not isinstance(saved, dict) or saved.get("fingerprint") != self.fingerprint:
            return None
        job_id, published = saved.get("job_id"), saved.get("published")
        if not isinstance(job_id, str) or not is_count(published):  # not ours, or damaged: run afresh
            return None
        return replace(self, job_id=job_id, published=published)

    def save(self) -> None:
        temporary = self.path.with_name(self.path.name + ".tmp")
        data = {"fingerprint": self.fingerprint, "job_id": self.job_id, "published": self.published}
        temporary.write_bytes(orjson.dumps(data))
        os.replace(temporary, self.path)

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


def fingerprint(path: Path, model: str, priority: str, database: str) -> str:
    """The same input file (path, size, modification time), model, priority and store: the same job."""
    info = path.stat()
    key = f"{path.resolve()}\0{info.st_size}\0{info.st_mtime_ns}\0{model}\0{priority}\0{database}"
    return hashlib.sha256(key.encode()).hexdigest()


# -- Ctrl-C -----------------------------------------------------------------------------------------------


class Interrupts:
    """SIGINT as a count the loop reads between steps. The handler only counts (it runs in the main thread,
    between two bytecodes, whatever the worker's threads do); the second one exits at once, with 130."""

    def __init__(self) -> None:
        self.count = 0
        self.event = threading.Event()
        self.on_exit: list[Callable[[], None]] = []

    def install(self) -> None:
        signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum: int, frame: object) -> None:
        self.count += 1
        self.event.set()
        if self.count < 2:
            return
        for cleanup in self.on_exit:
            with contextlib.suppress(OSError):
                cleanup()
        os.write(2, b"\ninterrupted again: exiting now\n")
        os._exit(130)  # at once: no thread joined, no atexit hook that could wait or raise

    def wait(self, timeout_s: float) -> None:
        self.event.wait(timeout_s)


# -- the run ----------------------------------------------------------------------------------------------


class Inputs:
    """The file's items from an index on, read as they are published; ``stored`` indices are passed over
    (a resumed embedded run republishes only what has no outcome)."""

    def __init__(self, path: Path, start: int, stored: set[int]) -> None:
        self.path = path
        self.next = start
        self.stored = stored
        self._lines = input_lines(path, skip=start)
        self.exhausted = False

    def take(self, size: int) -> tuple[int, list[Any]]:
        """Up to ``size`` items of consecutive indices: (index of the first, items)."""
        start, items = self.next, list[Any]()
        while len(items) < size:
            number_line = next(self._lines, None)
            if number_line is None:
                self.exhausted = True
                break
            index = self.next
            self.next += 1
            if index in self.stored:
                if items:
                    break
                start = self.next
                continue
            items.append(parse_line(self.path, *number_line))
        return start, items


class InOrder:
    """A job's results as they arrive, handed on in index order. Rows past a missing index wait here (at
    most AHEAD_BYTES of output lines); a poll reads the rows stored since the last one, and then only the
    range of the first missing index, so no row is read twice however long an early item takes."""

    def __init__(
        self, store: Any, job_id: str, start: int, format_line: Callable[[Any], bytes] = format_result
    ) -> None:
        self.store = store
        self.format_line = format_line
        self.job_id = job_id
        self.next = start  # the index to hand on next
        self.scanned = start - 1  # every row up to here was read (or handed on) when it was there
        self.ahead: deque[tuple[int, bytes]] = deque()  # rows past the first missing index, ascending
        self.ahead_bytes = 0
        self.filled: dict[int, bytes] = {}  # rows found in a missing range, not yet handed on
        self.backlog = False  # the last poll stopped for time with rows still to read

    def poll(self, until: float) -> list[bytes]:
        """The output lines that can be written now, in order."""
        self._scan(until)
        lines = self._hand_on()
        while self.ahead and time.monotonic() < until and self._fill_gap():
            lines += self._hand_on()
        return lines

    def _scan(self, until: float) -> None:
        self.backlog = False
        if self.ahead_bytes >= AHEAD_BYTES:
            return
        for count, result in enumerate(self.store.results(self.job_id, self.scanned), start=1):
            line = self.format_line(result)
            self.ahead.append((result.index, line))
            self.ahead_bytes += len(line)
            self.scanned = result.index
            if self.ahead_bytes >= AHEAD_BYTES or (count % 1000 == 0 and time.monotonic() > until):
                self.backlog = self.ahead_bytes < AHEAD_BYTES  # more rows wait: read again at once
                return

    def _fill_gap(self) -> bool:
        """Read the rows between the next index to hand on and the first row waiting; True if any."""
        found = False
        for result in self.store.results(self.job_id, self.next - 1, before=self.ahead[0][0]):
            if result.index not in self.filled:
                self.filled[result.index] = self.format_line(result)
                found = True
        return found

    def _hand_on(self) -> list[bytes]:
        lines: list[bytes] = []
        while True:
            if self.ahead and self.ahead[0][0] == self.next:
                line = self.ahead.popleft()[1]
                self.ahead_bytes -= len(line)
            elif self.next in self.filled:
                line = self.filled.pop(self.next)
            else:
                return lines
            lines.append(line)
            self.next += 1


class JobRun:
    """One job's run: publish a window ahead, write what arrived in order, follow the status, until every
    line is written; Ctrl-C cancels."""

    def __init__(
        self,
        client: Any,
        call: Any,
        path: Path,
        out: ResultFile,
        state: RunState | None,
        interrupts: Interrupts,
        format_line: Callable[[Any], bytes] = format_result,
    ) -> None:
        self.client = client
        self.format_line = format_line
        self.call = call
        self.path = path
        self.out = out
        self.state = state
        self.interrupts = interrupts
        self.written = 0
        self.inputs = Inputs(path, 0, set())
        self.status: Any = None
        self._next_status = 0.0
        self._next_save = 0.0
        self._next_read = 0.0
        self.window = window_items(path, call.total)
        self.ordered: InOrder | None = None

    def resume_from(self, written: int, published: int, embedded: bool) -> None:
        """Continue a killed run: ``written`` lines are in the output; items up to ``published`` were sent.
        A broker kept what it was sent; the in-memory broker died with the run, so its items with no
        outcome are sent again."""
        self.written = written
        if not embedded:
            self.inputs = Inputs(self.path, max(published, written), set())
            return
        stored = set()
        for result in self.client.results(self.call.job_id, after=written - 1):
            if result.index >= published:
                break
            stored.add(result.index)
        self.inputs = Inputs(self.path, written, stored)

    def run(self) -> Any:
        """Until every line is written; the job's final status."""
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=console, transient=False) as progress:
            bar = progress.add_task("items", total=self.call.total)
            while self.written < self.call.total:
                if self.interrupts.count:
                    progress.stop()
                    self.cancel()
                    return self.status
                sent = self._publish_some()
                wrote = self._write_due()
                if self._status_due():
                    status = self.status
                    progress.update(bar, completed=status.done + status.failed, description=status.state)
                    if status.state in _finished() and not (sent or wrote):
                        self._finish_early()
                if not sent:
                    self.interrupts.wait(max(0.0, self._next_read - time.monotonic()))
            self.status = self.client.status(self.call.job_id)
            progress.update(
                bar, completed=self.status.done + self.status.failed, description=self.status.state
            )
        return self.status

    def _status_due(self) -> bool:
        now = time.monotonic()
        if now < self._next_status:
            return False
        self._next_status = now + STATUS_EVERY_S
        self.status = self.client.status(self.call.job_id)
        return True

    def _publish_some(self) -> bool:
        sent = False
        size = self.client.settings.submit_chunk_size
        until = time.monotonic() + STEP_S
        while not self.inputs.exhausted and self.inputs.next - self.written < self.window:
            try:
                start, items = self.inputs.take(min(size, self.call.total - self.inputs.next))
            except InputFileError as exc:  # it was checked whole before any work: it changed since
                self.client.cancel(self.call.job_id)
                raise InputFileError(
                    f"{exc}; {self.path} changed while it ran: the job {self.call.job_id} is cancelled"
                ) from None
            if self.inputs.next >= self.call.total:
                self.inputs.exhausted = True
            elif self.inputs.exhausted:
                self.client.cancel(self.call.job_id)
                raise InputFileError(
                    f"{self.path} changed while it ran: the job {self.call.job_id} is cancelled"
                )
            if items:
                self.client.jobs.publish(self.call.window(start, items))
                sent = True
            if time.monotonic() > until:
                break
        # Saved at least every SAVE_EVERY_S, and once the last part is sent: a successor sends only the rest.
        due = time.monotonic() >= self._next_save or self.inputs.exhausted
        if sent and self.state is not None and due:
            self.state.published = self.inputs.next
            self.state.save()
            self._next_save = time.monotonic() + SAVE_EVERY_S
        return sent

    def _write_due(self) -> bool:
        now = time.monotonic()
        if now < self._next_read:
            return False
        wrote = self._write_some()
        self._next_read = now + (0 if self.ordered and self.ordered.backlog else READ_EVERY_S)
        return wrote

    def _write_some(self) -> bool:
        """Results that arrived, in order, up to the first one missing."""
        if self.ordered is None or self.ordered.next != self.written:
            self.ordered = InOrder(self.client.store, self.call.job_id, self.written, self.format_line)
        lines = self.ordered.poll(time.monotonic() + STEP_S)
        self.out.write(b"".join(lines))
        self.written += len(lines)
        return bool(lines)

    def _finish_early(self) -> None:
        """The job finished before every line was written: cancelled, failed or lost elsewhere."""
        while self._write_some():
            pass
        if self.written >= self.call.total:
            return
        if self.status.state == _cancelled():
            self.cancel()
            return
        self._write_rest(f"no result was stored (the job {self.status.state}: {self.status.error or '?'})")

    def cancel(self) -> None:
        """Cancel the job, its unfinished items stored as cancelled; then write every line from the store."""
        console.print(
            Text(f"interrupted: cancelling job {self.call.job_id} (Ctrl-C again exits at once)")
            if self.interrupts.count
            else Text(f"job {self.call.job_id} was cancelled")
        )
        self.client.cancel(self.call.job_id, unfinished=self._unstored())
        self._write_rest("no result was stored")
        self.status = self.client.status(self.call.job_id)

    def _unstored(self) -> Iterator[tuple[int, str | None]]:
        """(index, user id) of every item from the first unwritten one that has no stored outcome."""
        from worker.calls import item_id

        stored = iter(self.client.results(self.call.job_id, after=self.written - 1))
        upcoming = next(stored, None)
        for index, (number, line) in enumerate(input_lines(self.path, skip=self.written), self.written):
            if upcoming is not None and upcoming.index == index:
                upcoming = next(stored, None)
                continue
            try:
                ident = item_id(index, parse_line(self.path, number, line))
            except InvalidInput:
                ident = None
            yield index, ident

    def _write_rest(self, missing: str) -> None:
        """Every line not written yet, from the store; an item with no stored outcome says ``missing``."""
        from worker.client import ItemResult

        stored = self.client.results(self.call.job_id, after=self.written - 1)
        for result in stored:
            while self.written < result.index:
                self.out.write(self.format_line(ItemResult(self.written, None, missing, None)))
                self.written += 1
            self.out.write(self.format_line(result))
            self.written += 1
        while self.written < self.call.total:
            self.out.write(self.format_line(ItemResult(self.written, None, missing, None)))
            self.written += 1


def window_items(path: Path, total: int) -> int:
    """How many items may be published ahead of the output: WINDOW_ITEMS, or fewer for long lines."""
    line_bytes = max(1, path.stat().st_size // max(total, 1))
    return max(1000, min(WINDOW_ITEMS, WINDOW_BYTES // line_bytes))


def _finished() -> tuple[str, ...]:
    from worker.store.values import FINISHED_STATES  # lazily: the store's package loads SQLAlchemy

    return FINISHED_STATES


def _cancelled() -> str:
    from worker.store.values import JobState

    return JobState.CANCELLED
