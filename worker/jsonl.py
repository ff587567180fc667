"""Input and output files: one JSON object a line, checked line by line before anything runs."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

import orjson

from worker.models.base import InvalidInput
from worker.models.registry import model_class
from worker.settings import Settings


class InputFileError(ValueError):
    """A problem with an input file, naming the line."""


def read_inputs(path: Path, model: str, settings: Settings) -> list[Any]:
    """Every non-blank line of ``path`` as one input, each checked by the model."""
    validate = model_class(model).validate
    inputs: list[Any] = []
    try:
        lines = path.read_bytes().splitlines()
    except OSError as exc:
        raise InputFileError(f"{path}: {exc.strerror}") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            item = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            raise InputFileError(f"{path}, line {number}: not valid JSON ({exc})") from None
        try:
            validate(len(inputs), item, settings.max_input_chars)
        except InvalidInput as exc:
            raise InputFileError(f"{path}, line {number}: {exc.detail}") from None
        inputs.append(item)
        if len(inputs) > settings.max_items_per_job:
            raise InputFileError(
                f"{path}: more than {settings.max_items_per_job} items (BATCHWORK_MAX_ITEMS_PER_JOB)"
            )
    if not inputs:
        raise InputFileError(f"{path}: no inputs")
    return inputs


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
