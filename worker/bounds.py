"""What a value may be before it reaches SQL, a column or a Python slice: job ids, item ids, counts, indices,
limits, and any text or JSON a caller gives that is stored (item ids, metadata, names).

One definition, shared by the client, the CLI, the API's schemas (so /openapi.json states the bounds), the
worker's message checks and the store. PostgreSQL refuses a NUL character in text and JSON, SQLite takes it:
refusing it here keeps the two stores alike. No SQL, pydantic or Celery here.
"""

from __future__ import annotations

import math
import re
from typing import Any, TypeGuard

from worker.errors import InvalidInput

# Counts and item indices are 32-bit integers in SQL (jobs.total, results.item_index, ...).
MAX_COUNT = 2**31 - 1
# JSON integers go through orjson, which writes 64-bit integers at most.
MIN_JSON_INT = -(2**63)
MAX_JSON_INT = 2**64 - 1
# JSON a caller gives (metadata) is nested this deep at most: deeper is no one's metadata, and the encoder's
# recursion would fail on it.
MAX_JSON_DEPTH = 64
# The longest user id an item may carry (results.item_id) and the longest model name a job row keeps.
MAX_ITEM_ID_CHARS = 200
MAX_MODEL_NAME_CHARS = 200
# Job ids are UUIDs in their canonical form: 36 characters, lower case.
JOB_ID_PATTERN = r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$"
_JOB_ID = re.compile(JOB_ID_PATTERN)
# What no database column takes: NUL (PostgreSQL refuses it in text and JSON) and lone UTF-16 surrogates
# (no UTF-8 encoding exists for them).
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


def is_job_id(value: object) -> TypeGuard[str]:
    """True for a job id as batchwork makes them (a canonical UUID); anything else names no job."""
    return isinstance(value, str) and _JOB_ID.fullmatch(value) is not None


def is_count(value: object) -> TypeGuard[int]:
    """True for an integer a count or an item index may be: 0 .. MAX_COUNT (bool is not a count)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_COUNT


def unstorable(text: str) -> str | None:
    """What in ``text`` no database column stores (a NUL, a lone surrogate), or None."""
    found = _UNSTORABLE.search(text)
    if found is None:
        return None
    char = found.group()
    return "a NUL character" if char == "\x00" else f"a lone surrogate (U+{ord(char):04X})"


def all_storable(texts: list[str]) -> bool:
    """True if no text of ``texts`` holds what ``unstorable`` finds, checked at once: a search for NUL and
    a strict UTF-8 encoding (which fails on any lone surrogate), C loops several times faster than the
    pattern over a long text."""
    joined = "\n".join(texts)
    if "\x00" in joined:
        return False
    try:
        joined.encode()
    except UnicodeEncodeError:
        return False
    return True


def storable(text: str) -> str:
    """``text`` with what no column stores written as escapes (``\\x00``, ``\\ud800``): for texts of ours that
    repeat a caller's value, such as an exception's message, so both stores keep the same line."""
    if unstorable(text) is None:
        return text
    return _UNSTORABLE.sub(lambda found: found.group().encode("unicode_escape").decode(), text)


def check_text(text: str, what: str, index: int | None = None) -> str:
    """``text`` if every character of it can be stored, else InvalidInput naming ``what`` holds."""
    problem = unstorable(text)
    if problem is not None:
        raise InvalidInput(f"{what} holds {problem}, which cannot be stored", index)
    return text


def check_json(value: Any, what: str) -> Any:
    """``value`` (a caller's JSON value: metadata) if the store can keep it, else InvalidInput naming the
    first part that it cannot: a string or key with a NUL or lone surrogate, an integer beyond 64 bits, a
    value that is not JSON, or nesting deeper than MAX_JSON_DEPTH. A walk over a stack, never recursion."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        part, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise InvalidInput(f"{what} is nested deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(part, dict):
            for key, item in part.items():
                if not isinstance(key, str):
                    raise InvalidInput(f"{what} has a key that is not a string: {key!r:.40}")
                check_text(key, f"a key of {what}")
                stack.append((item, depth + 1))
        elif isinstance(part, list | tuple):
            stack.extend((item, depth + 1) for item in part)
        else:
            _check_json_leaf(part, what)
    return value


def _check_json_leaf(part: Any, what: str) -> None:
    if isinstance(part, str):
        check_text(part, what)
    elif isinstance(part, int) and not isinstance(part, bool):
        if not MIN_JSON_INT <= part <= MAX_JSON_INT:  # its bits, not its digits: str() of a huge one raises
            raise InvalidInput(f"{what} holds an integer beyond 64 bits (of {part.bit_length()} bits)")
    elif isinstance(part, float):
        if not math.isfinite(part):  # JSON has no NaN or infinity: the column would keep null
            raise InvalidInput(f"{what} holds {part}, which JSON cannot hold")
    elif not (part is None or isinstance(part, bool)):
        raise InvalidInput(f"{what} holds a {type(part).__name__}, which is not JSON")
