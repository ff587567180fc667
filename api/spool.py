"""An NDJSON job body, read as it arrives: each chunk of lines checked by the producers' own checks
(``new_call`` and ``check_items``) and kept in a temporary file, then published from that file.

Memory holds one chunk, never the body. A bad line anywhere refuses the whole body before anything is
registered or enqueued. Each line is parsed once, to be checked: the spool keeps the lines as they came,
already joined into the messages' parts, so publishing encodes no item again.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import IO, Any

import orjson

from api.limits import check_job_size
from worker.broker.producer import parts
from worker.calls import check_items, new_call
from worker.errors import InvalidInput
from worker.settings import Settings

# A line holds one item of at most max_input_chars characters; JSON may spell a character in up to six
# bytes (\uXXXX), plus the item's other fields. A longer line is refused before it fills memory.
LINE_OVERHEAD_BYTES = 64 * 1024


class NdjsonSpool:
    def __init__(self, model: str, priority: str, settings: Settings, file: IO[bytes]) -> None:
        self.model = model
        self.priority = priority
        self.settings = settings
        self.total = 0  # items checked and spooled
        self._file = file  # a temporary file of the caller's
        self._line = 0  # lines seen, blank ones included, for error messages
        self._partial = b""  # the end of the last chunk, up to its first unfinished line
        self._items: list[Any] = []
        self._raws: list[bytes] = []  # each item's line as it came: the spool keeps it as it is
        self._lines: list[int] = []  # line number of each item in _items
        self._max_line_bytes = settings.max_input_chars * 6 + LINE_OVERHEAD_BYTES

    def feed(self, data: bytes) -> None:
        """Take the next bytes of the body; raise InvalidInput (naming the line) or a 429 on the first
        line that cannot run."""
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        if len(self._partial) > self._max_line_bytes:
            raise InvalidInput(f"line {self._line + len(lines) + 1}: over {self._max_line_bytes} bytes")
        self._take(lines)

    def finish(self) -> int:
        """The body has ended: check what is left; returns the number of items."""
        if self._partial:
            self._take([self._partial])
            self._partial = b""
        while self._items:
            self._check_chunk()
        if self.total == 0:
            raise InvalidInput("the body holds no inputs: send one JSON input a line")
        return self.total

    def parts(self) -> Iterator[tuple[int, bytes]]:
        """The job's messages' parts as ``Publisher.send`` takes them, read back one at a time."""
        self._file.seek(0)
        while header := self._file.readline():
            offset, size = map(int, header.split())
            yield offset, self._file.read(size)

    def _take(self, lines: list[bytes]) -> None:
        """Parse whole lines, a chunk in C calls (a body has a line per item); blank lines are skipped."""
        first = self._line + 1
        self._line += len(lines)
        raws = [raw for raw in lines if raw.strip()]
        numbers = range(first, first + len(lines))
        if len(raws) < len(lines):
            numbers = [n for n, raw in zip(numbers, lines, strict=True) if raw.strip()]  # type: ignore[assignment]
        try:
            self._items += map(orjson.loads, raws)
        except orjson.JSONDecodeError:
            for number, raw in zip(numbers, raws, strict=True):  # which line: a rare path
                try:
                    orjson.loads(raw)
                except orjson.JSONDecodeError as exc:
                    raise InvalidInput(f"line {number}: not valid JSON ({exc})") from None
            raise
        self._raws += raws
        self._lines += numbers
        while len(self._items) >= self.settings.submit_chunk_size:
            self._check_chunk()

    def _check_chunk(self) -> None:
        """Check the next (at most) submit_chunk_size items and spool them as one message's part(s)."""
        size = self.settings.submit_chunk_size
        items, raws = self._items[:size], self._raws[:size]
        offset, count = self.total, self.total + len(items)
        check_job_size(count, self.settings)
        kwargs = {"model": self.model, "inputs": items, "priority": self.priority or None}
        call = replace(new_call("", kwargs, self.settings), offset=offset, total=count)
        try:
            check_items(call, self.settings)
        except InvalidInput as exc:
            if exc.index is None:
                raise
            raise InvalidInput(f"line {self._lines[exc.index - offset]}: {exc.detail}") from None
        for start, joined in parts(offset, raws, size):
            self._file.write(b"%d %d\n" % (start, len(joined)) + joined)
        self.priority = call.priority  # as the checks read it ("" is normal)
        self.total = count
        del self._items[:size], self._raws[:size], self._lines[:size]
