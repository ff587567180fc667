"""Input and output files: one JSON object a line; a mistake names the file, the line and the column.

Reading only parses: the items are checked once, by the client, whose errors name an item index that
``line_of`` turns back into a line. Writing goes to a temporary file that replaces the target only once
complete, so a failed write never truncates what was there. ``input_lines``/``parse_line`` and
``format_result`` are the one place a line is read or written, so another file format swaps them alone.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import orjson

from worker.errors import BatchworkError

BOM = b"\xef\xbb\xbf"


class InputFileError(BatchworkError, ValueError):
    """A problem with an input or output file, naming the file and the line."""


class Inputs(list[Any]):
    """A file's items, in order, with the line each came from."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path
        self.lines: list[int] = []

    def line_of(self, index: int | None) -> str:
        """Where item ``index`` came from, for a message: "path, line N"."""
        if index is None or not 0 <= index < len(self.lines):
            return str(self.path)
        return f"{self.path}, line {self.lines[index]}"


def read_inputs(path: Path, max_items: int) -> Inputs:
    """Every non-blank line of ``path`` as one JSON value (a UTF-8 byte-order mark is accepted)."""
    inputs = Inputs(path)
    for number, line in input_lines(path):
        inputs.append(parse_line(path, number, line))
        inputs.lines.append(number)
        if len(inputs) > max_items:
            raise too_many(path, max_items)
    if not inputs:
        raise InputFileError(f"{path}: no inputs")
    return inputs


def json_error(line: bytes, exc: orjson.JSONDecodeError) -> str:
    """Where in ``line`` it stops being JSON and why, as "column C: ...", C counting characters from 1.

    orjson says column 1 for any byte that is not UTF-8 (a Latin-1 file's 'é'); this points at that byte.
    """
    try:
        line.decode("utf-8")
    except UnicodeDecodeError as bad:
        column = len(line[: bad.start].decode("utf-8")) + 1
        return f"column {column}: not UTF-8 (byte 0x{line[bad.start]:02x}: save the file as UTF-8)"
    return f"column {exc.colno}: not valid JSON ({exc.msg})"


def input_lines(path: Path, skip: int = 0) -> Iterator[tuple[int, bytes]]:
    """``(line number, line)`` of every non-blank line of ``path``, read as a stream, but the first ``skip``
    (a UTF-8 byte-order mark at the start is dropped)."""
    try:
        with path.open("rb") as stream:
            for number, line in enumerate(stream, start=1):
                if number == 1:
                    line = line.removeprefix(BOM)
                if line.isspace() or not line:
                    continue
                if skip:
                    skip -= 1
                    continue
                yield number, line
    except OSError as exc:
        raise InputFileError(f"{path}: {exc.strerror or exc}") from None


def parse_line(path: Path, number: int, line: bytes) -> Any:
    """One line's item: its JSON value; a mistake names the file, the line and the column."""
    try:
        return orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        raise InputFileError(f"{path}, line {number}, {json_error(line, exc)}") from None


def too_many(path: Path, max_items: int) -> InputFileError:
    return InputFileError(f"{path}: more than {max_items} items (BATCHWORK_MAX_ITEMS_PER_JOB)")


def check_output_path(path: Path | None) -> None:
    """Refuse, before anything runs, an output path that could not be written: a file is created beside it
    and removed again (permission bits alone say nothing to root, nor of /proc or a read-only mount)."""
    if path is None:
        return
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise InputFileError(f"{path}: the folder {folder} does not exist")
    if path.is_dir():
        raise InputFileError(f"{path}: is a folder, not a file")
    if path.exists() and not path.is_file():  # the output replaces it whole: /dev/null would be a file after
        raise InputFileError(f"{path}: is not a regular file; leave -o out to write to standard output")
    if path.exists() and not os.access(path, os.W_OK):
        raise InputFileError(f"{path}: the file is not writable")
    try:
        handle, probe = tempfile.mkstemp(dir=folder, prefix=f".{path.name}.")
    except OSError as exc:
        raise InputFileError(f"{path}: cannot write in the folder {folder} ({exc.strerror or exc})") from None
    os.close(handle)
    os.unlink(probe)


@contextmanager
def output(path: Path | None) -> Iterator[IO[bytes]]:
    """Standard output, or a temporary file beside ``path`` that replaces it only once fully written."""
    if path is None:
        with os.fdopen(os.dup(1), "wb") as out:
            yield out
        return
    check_output_path(path)
    handle, temporary = tempfile.mkstemp(
        dir=path.parent if str(path.parent) else ".", prefix=f".{path.name}."
    )
    try:
        with os.fdopen(handle, "wb") as out:
            yield out
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


def write_results(out: IO[bytes], results: Iterable[Any]) -> int:
    """Write ``{"index", "id", "output"|"error"}`` lines; returns how many."""
    count = 0
    for result in results:
        out.write(format_result(result))
        count += 1
    return count


def format_result(result: Any) -> bytes:
    """One output line (newline included) for a result with ``index``, ``item_id``, ``output``, ``error``."""
    line: dict[str, Any] = {"index": result.index, "id": result.item_id}
    if result.error is None:
        line["output"] = result.output
    else:
        line["error"] = result.error
    return orjson.dumps(line, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n"


class ResultFile:
    """Output lines written as they come, in order: to standard output, or to ``.NAME.partial`` beside
    ``path``, which replaces ``path`` once complete. A partial file left by a killed run is continued (its
    complete lines kept, a torn last line dropped), so a resumed run writes each line once."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.partial = None if path is None else path.with_name(f".{path.name}.partial")
        self._out: IO[bytes] | None = None

    def open(self, resume: bool) -> int:
        """Start writing; the number of lines already written (resume), which the caller continues after."""
        if self.partial is None:
            self._out = os.fdopen(os.dup(1), "wb")
            return 0
        kept = _complete_lines(self.partial) if resume else None
        if kept is None:
            self._out = self.partial.open("wb")
            return 0
        lines, size = kept
        self._out = self.partial.open("r+b")
        self._out.truncate(size)
        self._out.seek(size)
        return lines

    def write(self, line: bytes) -> None:
        assert self._out is not None, "ResultFile.open first"
        self._out.write(line)

    def finish(self) -> None:
        """Every line is written: the partial file becomes ``path``."""
        if self._out is not None:
            self._out.close()
        if self.partial is not None and self.path is not None:
            os.replace(self.partial, self.path)

    def discard(self) -> None:
        if self._out is not None:
            self._out.close()
        if self.partial is not None and self.partial.exists():
            self.partial.unlink()


def _complete_lines(path: Path) -> tuple[int, int] | None:
    """(lines, bytes) of the complete lines at the start of a partial file, or None when there is no such
    file. The file was written in order, so only its end can be torn: the last complete line must be the
    result of index lines - 1, or nothing is kept."""
    try:
        stream = path.open("rb")
    except FileNotFoundError:
        return None
    lines = size = 0
    last = b""
    with stream:
        for line in stream:
            if not line.endswith(b"\n"):
                break
            lines += 1
            size += len(line)
            last = line
    if lines and _index_of(last) != lines - 1:
        return 0, 0
    return lines, size


def _index_of(line: bytes) -> int | None:
    try:
        index = orjson.loads(line).get("index")
    except (orjson.JSONDecodeError, AttributeError):
        return None
    return index if isinstance(index, int) else None
