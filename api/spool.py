"""An NDJSON job body, read as it arrives and kept in a temporary file, then published from that file.

The body is cut into pieces of whole lines (about a MiB each). ``check_piece`` parses and checks a piece with
the producers' own checks (``new_call`` and ``check_items``), in another process when it can (see
api/checking.py), and returns it cut into the messages' parts: the lines as they came, joined, so publishing
encodes no item again. Memory holds a few pieces, never the body. A bad line anywhere refuses the whole body
before anything is registered or enqueued.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import IO

import orjson

from api.limits import check_job_size
from worker.broker.producer import parts
from worker.calls import check_items, new_call
from worker.errors import InvalidInput
from worker.jsonl import json_error
from worker.settings import Settings

# A line holds one item of at most max_input_chars characters; JSON may spell a character in up to six
# bytes (\uXXXX), plus the item's other fields. A longer line is refused before it fills memory.
LINE_OVERHEAD_BYTES = 64 * 1024


@dataclass(frozen=True)
class Piece:
    data: bytes  # whole lines of the body (or its last line, which may lack its newline)
    first_line: int  # the body's number of its first line, counting from 1


@dataclass(frozen=True)
class CheckedPiece:
    items: int  # blank lines are no items
    parts: list[tuple[int, bytes]]  # the messages' parts, offsets counting from the piece's first item
    priority: str  # as the checks read it
    error: str | None = None  # the first line that cannot run, as the caller reads it


def check_piece(piece: Piece, model: str, priority: str, settings: Settings) -> CheckedPiece:
    """Parse and check a piece's lines. A checking process runs it, so a line that cannot run comes back as
    ``error``, never raised; a piece of more items than a job may hold comes back unchecked (the spool
    answers 429 from its count)."""
    lines = piece.data.split(b"\n")
    raws = [raw for raw in lines if raw.strip()]
    numbers: Sequence[int] = range(piece.first_line, piece.first_line + len(lines))
    if len(raws) < len(lines):
        numbers = [number for number, raw in zip(numbers, lines, strict=True) if raw.strip()]
    if not raws or len(raws) > settings.max_items_per_job:
        return CheckedPiece(len(raws), [], priority)
    try:
        items = list(map(orjson.loads, raws))  # one C call a line; the message says which line
    except orjson.JSONDecodeError:
        return CheckedPiece(0, [], priority, _first_bad_json(raws, numbers))
    try:
        call = new_call("", {"model": model, "inputs": items, "priority": priority or None}, settings)
        check_items(call, settings)
    except InvalidInput as exc:
        error = str(exc) if exc.index is None else f"line {numbers[exc.index]}: {exc.detail}"
        return CheckedPiece(0, [], priority, error)
    return CheckedPiece(len(items), list(parts(0, raws, settings.submit_chunk_size)), call.priority)


def _first_bad_json(raws: list[bytes], numbers: Sequence[int]) -> str:
    for number, raw in zip(numbers, raws, strict=True):
        try:
            orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            return f"line {number}, {json_error(raw, exc)}"
    raise AssertionError("a line failed to parse, then parsed")


class NdjsonSpool:
    """One body's pieces in, checked pieces spooled in body order, the job's parts out."""

    def __init__(self, model: str, priority: str, settings: Settings, file: IO[bytes]) -> None:
        self.model = model
        self.priority = priority
        self.settings = settings
        self.total = 0  # items checked and spooled
        self._file = file  # a temporary file of the caller's
        self._lines = 0  # lines cut into pieces so far, blank ones included, for error messages
        self._partial = b""  # the body's last bytes after its last newline so far
        self._max_line_bytes = settings.max_input_chars * 6 + LINE_OVERHEAD_BYTES

    def piece(self, data: bytes | bytearray) -> Piece | None:
        """The whole lines that the next bytes of the body complete, as a piece to check (None if they
        complete none); InvalidInput for a line too long to be one item. ``data`` is copied once, into the
        piece (the caller may reuse its buffer)."""
        end = data.rfind(b"\n") + 1
        lines = data.count(b"\n", 0, end)
        if not end:
            self._partial += data
        else:
            whole = self._partial + memoryview(data)[:end]
            self._partial = bytes(memoryview(data)[end:])
        if len(self._partial) > self._max_line_bytes:
            raise InvalidInput(f"line {self._lines + lines + 1}: over {self._max_line_bytes} bytes")
        if not end:
            return None
        piece = Piece(whole, self._lines + 1)
        self._lines += lines
        return piece

    def last_piece(self) -> Piece | None:
        """The body has ended: its last line, if it had no newline."""
        piece = Piece(self._partial, self._lines + 1) if self._partial.strip() else None
        self._partial = b""
        return piece

    def add(self, checked: CheckedPiece) -> None:
        """Spool the next piece of the body, checked: InvalidInput naming its bad line, or 429 once the job
        would hold more items than a job may."""
        check_job_size(self.total + checked.items, self.settings)
        if checked.error is not None:
            raise InvalidInput(checked.error)
        for offset, joined in checked.parts:
            self._file.write(b"%d %d\n" % (self.total + offset, len(joined)) + joined)
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
        self._file.seek(0)
        while header := self._file.readline():
            offset, size = map(int, header.split())
            yield offset, self._file.read(size)
