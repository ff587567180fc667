"""Input and output files: one JSON object a line; a mistake names the file, the line and the column.

Reading only parses: the items are checked once, by the client, whose errors name an item index that
``line_of`` turns back into a line. Writing goes to a temporary file that replaces the target only once
complete, so a failed write never truncates what was there.
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
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise InputFileError(f"{path}: {exc.strerror or exc}") from None
    inputs = Inputs(path)
    for number, line in enumerate(data.removeprefix(BOM).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            inputs.append(orjson.loads(line))
        except orjson.JSONDecodeError as exc:
            raise InputFileError(f"{path}, line {number}, {json_error(line, exc)}") from None
        inputs.lines.append(number)
        if len(inputs) > max_items:
            raise InputFileError(f"{path}: more than {max_items} items (BATCHWORK_MAX_ITEMS_PER_JOB)")
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


def check_output_path(path: Path | None) -> None:
    """Refuse, before anything runs, an output path that could not be written."""
    if path is None:
        return
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise InputFileError(f"{path}: the folder {folder} does not exist")
    if path.is_dir():
        raise InputFileError(f"{path}: is a folder, not a file")
    if not os.access(folder, os.W_OK):
        raise InputFileError(f"{path}: the folder {folder} is not writable")


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
        line: dict[str, Any] = {"index": result.index, "id": result.item_id}
        if result.error is None:
            line["output"] = result.output
        else:
            line["error"] = result.error
        out.write(orjson.dumps(line, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n")
        count += 1
    return count
