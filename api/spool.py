"""An NDJSON job body, written to a temporary file as it arrives, checked in byte ranges of that file, then
published from it.

The body is cut into pieces of whole lines (a few hundred KiB each), named by their byte range in the file.
``check_piece`` reads a piece's bytes from the file, parses and checks its lines with the producers' own
checks (``new_job`` and ``check_items``), in another process when it can (see api/checking.py), and returns
the messages' parts as byte ranges of the file: runs of consecutive lines, which become a message's items
with their newlines turned into commas, as they came. So only file names and numbers cross between the
processes, and publishing encodes no item again. Memory holds the bytes of a piece or a part at a time,
never the body. A bad line anywhere refuses the whole body before anything is registered or enqueued.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import IO

import orjson

from api.limits import check_job_size
from worker.broker.producer import MAX_MESSAGE_BYTES, Publisher
from worker.calls import NewJob, check_items, new_job
from worker.errors import InvalidInput
from worker.jsonl import BOM, json_error
from worker.settings import Settings

# A line holds one item of at most max_input_chars characters; JSON may spell a character in up to six
# bytes (\uXXXX), plus the item's other fields. A longer line is refused before it fills memory.
LINE_OVERHEAD_BYTES = 64 * 1024
# A line, newline included, of nothing but what ``bytes.strip`` strips (ASCII whitespace), found in one scan.
_BLANK_LINE = re.compile(rb"\n[ \t\r\x0b\x0c]*\n")  # the first line aside: a leading literal is scanned fast


@dataclass(frozen=True)
class Piece:
    path: str  # the body's temporary file
    start: int  # its bytes start .. end-1: whole lines (or the body's last line, which may lack its newline)
    end: int
    first_line: int  # the body's number of its first line, counting from 1


# A message's part as a byte range of the body's file: (offset of its first item, start, end), the lines
# in between consecutive and none blank; the last line's newline is not in it.
PartRange = tuple[int, int, int]


@dataclass(frozen=True)
class CheckedPiece:
    items: int  # blank lines are no items
    parts: list[PartRange]  # the messages' parts, offsets counting from the piece's first item
    priority: str  # as the checks read it
    error: str | None = None  # the first line that cannot run, as the caller reads it


def check_piece(piece: Piece, model: str, priority: str, settings: Settings) -> CheckedPiece:
    """Parse and check a piece's lines. A checking process runs it, so a line that cannot run comes back as
    ``error``, never raised; a piece of more items than a job may hold comes back unchecked (the spool
    answers 429 from its count)."""
    with open(piece.path, "rb", buffering=0) as file:
        data = os.pread(file.fileno(), piece.end - piece.start, piece.start)
    lines = data.split(b"\n")
    if data.endswith(b"\n"):
        lines.pop()  # the piece's last newline ends its last line: no line follows it
    blank = has_blank_line(data, lines)
    raws = list(filter(bytes.strip, lines)) if blank else lines  # blank lines are no items
    numbers: Sequence[int] = range(piece.first_line, piece.first_line + len(lines))
    if blank:
        numbers = [number for number, raw in zip(numbers, lines, strict=True) if raw.strip()]
    if not raws or len(raws) > settings.max_items_per_job:
        return CheckedPiece(len(raws), [], priority)
    try:
        items = list(map(orjson.loads, raws))  # one C call a line; the message says which line
    except orjson.JSONDecodeError:
        return CheckedPiece(0, [], priority, _first_bad_json(raws, numbers))
    try:
        # Checked only: the job (and its id) is made once every piece passed (api/jobs.py, NewJob.header).
        call = new_job("", {"model": model, "inputs": items, "priority": priority or None}, settings)
        check_items(call, settings)
    except InvalidInput as exc:
        error = str(exc) if exc.index is None else f"line {numbers[exc.index]}: {exc.detail}"
        return CheckedPiece(0, [], priority, error)
    return CheckedPiece(
        len(items),
        part_ranges(piece.start, lines, settings.submit_chunk_size, blank),
        call.priority,
    )


def has_blank_line(data: bytes, lines: list[bytes]) -> bool:
    """Whether a line of ``data`` (split into ``lines``, no line after its last newline) is blank, in one
    scan: a Python test per line was a tenth of a piece's check."""
    if not lines or not lines[0].strip() or not lines[-1].strip():
        return bool(lines)
    return _BLANK_LINE.search(data) is not None


def part_ranges(start: int, lines: list[bytes], chunk_size: int, blank: bool = True) -> list[PartRange]:
    """The messages' parts of ``lines`` (whole lines of the file from byte ``start``, newlines taken off) as
    byte ranges: at most ``chunk_size`` items and about MAX_MESSAGE_BYTES each, cut at every blank line.
    ``blank``: whether any line may be blank."""
    sizes = list(accumulate(map(len, lines)))  # C: a Python step per line was half of a piece's check

    def line_end(i: int) -> int:  # where line i ends: its bytes and the lines' and newlines' before it
        return start + sizes[i] + i

    if not blank and line_end(len(lines) - 1) - start <= MAX_MESSAGE_BYTES:  # the common piece: cut by count
        return [
            (
                first,
                line_end(first - 1) + 1 if first else start,
                line_end(min(first + chunk_size, len(lines)) - 1),
            )
            for first in range(0, len(lines), chunk_size)
        ]
    ends = list(map(line_end, range(len(lines))))
    ranges: list[PartRange] = []
    items = count = 0
    first: tuple[int, int] | None = None  # the part being cut: its first item's offset and its first byte
    last_end = start
    for line, end in zip(lines, ends, strict=True):
        empty = not line.strip()
        if first is not None and (empty or count >= chunk_size or end - first[1] > MAX_MESSAGE_BYTES):
            ranges.append((*first, last_end))
            first = None
        if not empty:
            if first is None:
                first, count = (items, end - len(line)), 0
            items += 1
            count += 1
        last_end = end
    if first is not None:
        ranges.append((*first, last_end))
    return ranges


def _first_bad_json(raws: list[bytes], numbers: Sequence[int]) -> str:
    for number, raw in zip(numbers, raws, strict=True):
        try:
            orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            return f"line {number}, {json_error(raw, exc)}"
    raise AssertionError("a line failed to parse, then parsed")


class NdjsonSpool:
    """One body written to a temporary file and cut into pieces, checked pieces spooled in body order (their
    parts' ranges), the job's parts read back out."""

    def __init__(self, model: str, priority: str, settings: Settings, file: IO[bytes]) -> None:
        self.model = model
        self.priority = priority
        self.settings = settings
        self.total = 0  # items checked and spooled
        self._file = file  # a named temporary file of the caller's, which the checks open by name
        self._written = 0  # the body's bytes in the file so far
        self._cut = 0  # where the bytes not yet in a piece start: the body's last, unfinished line
        self._lines = 0  # lines cut into pieces so far, blank ones included, for error messages
        self._parts: list[PartRange] = []  # the job's parts, offsets counting from its first item
        self._max_line_bytes = settings.max_input_chars * 6 + LINE_OVERHEAD_BYTES

    @property
    def path(self) -> str:
        return self._file.name

    def piece(self, data: bytes | bytearray) -> Piece | None:
        """Write the next bytes of the body to the file; the whole lines they complete, as a piece to check
        (None if they complete none); InvalidInput for a line too long to be one item."""
        self._file.write(data)
        self._file.flush()  # the checks read the file from other processes
        if self._written == 0 and data.startswith(BOM):
            self._cut = len(BOM)  # as `batchwork run` and an OpenAI file: no part of line 1
        written, self._written = self._written, self._written + len(data)
        end = data.rfind(b"\n") + 1
        lines = data.count(b"\n", 0, end)
        if self._written - (written + end if end else self._cut) > self._max_line_bytes:
            raise InvalidInput(f"line {self._lines + lines + 1}: over {self._max_line_bytes} bytes")
        if not end:
            return None
        piece = Piece(self._file.name, self._cut, written + end, self._lines + 1)
        self._cut = piece.end
        self._lines += lines
        return piece

    def last_piece(self) -> Piece | None:
        """The body has ended: its last line, if it had no newline."""
        if self._cut == self._written:
            return None
        piece = Piece(self._file.name, self._cut, self._written, self._lines + 1)
        self._cut = self._written
        return piece

    def add(self, checked: CheckedPiece) -> None:
        """Spool the next piece of the body, checked: InvalidInput naming its bad line, or 429 once the job
        would hold more items than a job may."""
        check_job_size(self.total + checked.items, self.settings)
        if checked.error is not None:
            raise InvalidInput(checked.error)
        self._parts.extend((self.total + offset, start, end) for offset, start, end in checked.parts)
        self.total += checked.items
        if checked.items:
            self.priority = checked.priority

    def finish(self) -> int:
        """The number of items spooled; InvalidInput if the body held none."""
        if self.total == 0:
            raise InvalidInput("the body holds no inputs: send one JSON input a line")
        return self.total

    def parts(self) -> Iterator[tuple[int, bytes]]:
        """The job's messages' parts as ``Publisher.send`` takes them, read back one at a time."""
        return part_bytes(self._file.fileno(), self._parts)

    def part_ranges(self, slices: int) -> list[list[PartRange]]:
        """The job's parts as byte ranges of the body's file, in up to ``slices`` runs of consecutive parts
        (the first holds the job's first message), for ``send_ranges`` in as many processes."""
        size = -(-len(self._parts) // slices)
        return [self._parts[first : first + size] for first in range(0, len(self._parts), size)]


def part_bytes(fd: int, ranges: Iterable[PartRange]) -> Iterator[tuple[int, bytes]]:
    """Messages' parts read from the body's file one at a time, as ``Publisher.send`` takes them: a run of
    lines as they came, their newlines made commas (the items' JSON joined, as a message holds it)."""
    for offset, start, end in ranges:
        yield offset, os.pread(fd, end - start, start).replace(b"\n", b",")


# A checking process's own publisher, by broker URL: connected once, reused by every upload.
_PUBLISHERS: dict[str, Publisher] = {}


def publisher(settings: Settings) -> Publisher:
    from worker.jobs import RedisMessages

    if settings.broker_url not in _PUBLISHERS:
        _PUBLISHERS[settings.broker_url] = RedisMessages(settings).publisher
    return _PUBLISHERS[settings.broker_url]


def send_ranges(path: str, ranges: list[PartRange], call: NewJob, first: bool, settings: Settings) -> int:
    """Send the messages of ``ranges`` of the body's file ``path`` (a checking process does, beside the
    others); ``first``: they begin with the job's first message, which carries the job id as its task id.
    How many messages."""
    with open(path, "rb", buffering=0) as file:
        parts = part_bytes(file.fileno(), ranges)
        return publisher(settings).send(call, parts, task_id=call.job_id if first else None)
