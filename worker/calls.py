"""What one `batchwork.infer` call or message asks for, and the checks every item passes.

A producer turns a call into a NewJob (``new_job``) and sends it as messages; a worker reads each message
back as an InferMessage (``parse_message``). Producers check a call's arguments and every item before
anything is enqueued; the worker checks each message it receives once more (a raw Celery call can skip the
producer) and turns what fails into stored errors. Every value a caller or a message carries is bounded
here, before it can reach the store. No Celery, Redis, SQL or torch here.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from itertools import repeat
from typing import Any

from worker.batching.policy import PRIORITIES
from worker.bounds import MAX_COUNT, MAX_ITEM_ID_CHARS, all_storable, check_text, is_count, is_job_id
from worker.errors import MODEL_FAILURES
from worker.models.base import InvalidInput, Model
from worker.models.registry import model_class, shown
from worker.settings import Settings

__all__ = [
    "MAX_COUNT",
    "MAX_ITEM_ID_CHARS",
    "InferMessage",
    "check_item",
    "check_items",
    "job_id_of",
    "new_job",
    "NewJob",
    "plain_items",
]

TASK_NAME = "batchwork.infer"
_DEFAULT_VALIDATE = Model.validate.__func__  # type: ignore[attr-defined]
# An integer id of more bits has more than MAX_ITEM_ID_CHARS digits (over 3.3 bits a digit): refused unread.
_MAX_ID_BITS = MAX_ITEM_ID_CHARS * 4
# What a caller passes to infer.delay / client.submit.
CALL_ARGUMENTS = ("model", "inputs", "priority", "deadline_s")
# What a message carries: the call, plus which job its items belong to and where they sit in it.
# A time past this (the year 3000) is no one's clock: it is refused before a datetime or database meets it.
LAST_UNIX_TIME = 32_503_680_000
# ``indices``: the job index of each item, where a message's items are not the job's consecutive items from
# ``offset`` on (a producer that ordered a job's items by length; see broker/producer.py).
MESSAGE_ARGUMENTS = (
    *("model", "inputs", "priority", "job_id", "offset", "total", "expires_at", "created_at", "indices"),
)


@dataclass(frozen=True, slots=True)
class NewJob:
    """A job as a producer sends it: its fields, and its items from job index ``offset`` on (all of them;
    a window of them, for a producer that publishes a job in parts; or none, ``header``). The worker never
    sees one: each message it receives is an InferMessage."""

    job_id: str
    model: str
    inputs: Sequence[Any]
    priority: str = "normal"
    offset: int = 0  # the job index of ``inputs[0]``
    total: int = 0
    expires_at: float | None = None  # Unix time after which items not yet started end as expired
    created_at: float | None = None  # Unix time the producer accepted the job

    @classmethod
    def header(
        cls,
        job_id: str,
        model: str,
        priority: str,
        total: int,
        expires_at: float | None = None,
        created_at: float | None = None,
    ) -> NewJob:
        """A job of ``total`` items without them: what is recorded and what each message repeats, for a
        producer that sends the items already encoded (``Jobs.publish``'s parts) or a window at a time."""
        return cls(job_id, model, (), priority, 0, total, expires_at, created_at)

    def window(self, offset: int, inputs: Sequence[Any]) -> NewJob:
        """This job with its items from job index ``offset`` on (``batchwork run``: a window at a time)."""
        return replace(self, inputs=inputs, offset=offset)

    def fields(self) -> dict[str, Any]:
        """The keyword arguments of this job's messages but the inputs (and ``offset``, which is the first
        message's)."""
        return _header(self)

    def message(self, start: int, size: int) -> InferMessage:
        """The message carrying ``inputs[start : start + size]`` (job indices ``offset + start`` on)."""
        return InferMessage(
            self.job_id,
            self.model,
            self.inputs[start : start + size],
            self.priority,
            self.offset + start,
            self.total,
            self.expires_at,
            self.created_at,
        )


@dataclass(frozen=True, slots=True)
class InferMessage:
    """One message as a worker receives it: items ``offset .. offset+len(inputs)-1`` of job ``job_id`` (of
    ``total`` items), or the items at ``indices``."""

    job_id: str
    model: str
    inputs: Sequence[Any]
    priority: str = "normal"
    offset: int = 0
    total: int = 0
    expires_at: float | None = None  # Unix time after which items not yet started end as expired
    created_at: float | None = None  # Unix time the producer accepted the job
    indices: Sequence[int] | None = None  # each item's job index; None: offset, offset + 1, ...

    def index(self, position: int) -> int:
        """The job index of the message's item at ``position``."""
        return self.offset + position if self.indices is None else self.indices[position]

    def kwargs(self) -> dict[str, Any]:
        """The message's keyword arguments, as ``parse_message`` reads them back."""
        kwargs = _header(self)
        if self.indices is not None:
            kwargs["indices"] = list(self.indices)
        return {**kwargs, "inputs": list(self.inputs)}


def _header(call: NewJob | InferMessage) -> dict[str, Any]:
    """The keyword arguments every message of a job carries but its items (the same for both shapes)."""
    header: dict[str, Any] = {
        "model": call.model,
        "priority": call.priority,
        "job_id": call.job_id,
        "offset": call.offset,
        "total": call.total,
    }
    if call.expires_at is not None:
        header["expires_at"] = call.expires_at
    if call.created_at is not None:
        header["created_at"] = call.created_at
    return header


def new_job(job_id: str, kwargs: Mapping[str, Any], settings: Settings) -> NewJob:
    """A producer's call (``model``, ``inputs``, ``priority``, ``deadline_s``) as job ``job_id``; the items
    themselves are checked by ``check_items``. InvalidInput names the argument at fault."""
    _refuse_unknown(kwargs, CALL_ARGUMENTS)
    model = _model(kwargs.get("model"), settings)
    inputs = _inputs(kwargs.get("inputs"), settings)
    return NewJob(
        job_id=job_id,
        model=model,
        inputs=inputs,
        priority=priority_of(kwargs.get("priority")),
        total=len(inputs),
        expires_at=expiry(kwargs.get("deadline_s")),
        created_at=time.time(),
    )


def parse_message(task_id: str, kwargs: object, settings: Settings) -> InferMessage:
    """The call a received message carries; InvalidInput for anything wrong but the items themselves."""
    if not isinstance(kwargs, dict):
        raise InvalidInput("the message's keyword arguments are not an object")
    _refuse_unknown(kwargs, MESSAGE_ARGUMENTS)
    model = _model(kwargs.get("model"), settings)
    inputs = _inputs(kwargs.get("inputs"), settings)
    offset = _count(kwargs.get("offset", 0), "offset")
    total = _count(kwargs.get("total", offset + len(inputs)), "total")
    if total > settings.max_items_per_job:
        raise InvalidInput(f"a job holds at most {settings.max_items_per_job} items, this one {total}")
    if offset + len(inputs) > total:
        raise InvalidInput(
            f"items {offset}..{offset + len(inputs) - 1} lie beyond the job's total of {total}"
        )
    return InferMessage(
        job_id=job_id_of(kwargs.get("job_id", task_id), "job_id" if "job_id" in kwargs else "the task id"),
        model=model,
        inputs=inputs,
        priority=priority_of(kwargs.get("priority")),
        offset=offset,
        total=total,
        expires_at=_unix_time(kwargs.get("expires_at"), "expires_at"),
        created_at=_unix_time(kwargs.get("created_at"), "created_at"),
        indices=_indices(kwargs.get("indices"), len(inputs), total),
    )


def check_items(call: NewJob, settings: Settings) -> None:
    """Raise InvalidInput naming the first item the model cannot take (producer side)."""
    cls = model_class(call.model, settings)
    if plain_items(cls, call.inputs, settings) is not None:
        return
    for position, item in enumerate(call.inputs):
        check_item(cls, call.offset + position, item, settings)


def plain_texts(cls: type[Model], items: Sequence[object], settings: Settings) -> list[str] | None:
    """``plain_items``' texts, where no item has an id (None otherwise)."""
    plain = plain_items(cls, items, settings)
    return plain[0] if plain is not None and plain[1] is None else None


def plain_items(
    cls: type[Model], items: Sequence[object], settings: Settings
) -> tuple[list[str], list[str | None] | None] | None:
    """What the default check (``Model.validate``) and ``item_id`` make of every item, checked a list at a
    time, where all items are texts it takes as they are: strings, or objects with a string ``text`` and an
    ``id`` that is absent, null, a string or an integer. The texts, and the user ids (None where no item has
    one). None where the model checks items its own way or any item is another shape or wrong: then each
    item is checked alone (``check_item``), which names the first mistake.

    The same outcome as ``check_item`` on each, in loops that run in C: the per-item check was most of a
    noop worker's prepare thread, of ``submit``'s own time and of the API's checks of an NDJSON body."""
    if getattr(cls.validate, "__func__", None) is not _DEFAULT_VALIDATE or not items:
        return None
    kinds = set(map(type, items))
    texts: list[Any]
    ids: list[Any] | None = None
    if kinds == {dict}:
        texts = list(map(dict.get, items, repeat("text")))  # type: ignore[arg-type]
        if set(map(type, texts)) != {str}:
            return None
        ids = list(map(dict.get, items, repeat("id")))  # type: ignore[arg-type]
        ids = _plain_ids(ids) if ids.count(None) != len(ids) else None
        if ids == []:
            return None
    elif kinds == {str}:
        texts = items if isinstance(items, list) else list(items)
    else:
        return None
    # An empty text, or one of whitespace alone, is refused (``not text.strip()`` in ``text_of``).
    if "" in texts or any(map(str.isspace, texts)) or max(map(len, texts)) > settings.max_input_chars:
        return None
    return texts, ids


def _plain_ids(ids: list[Any]) -> list[str | None]:
    """``item_id``'s ids of a list at a time (strings, integers, None), or [] where any would be refused
    (another type, too long, a character no column stores): then each item is checked alone."""
    kinds = set(map(type, ids))
    if not kinds <= {str, int, type(None)}:  # bool, float, ...: item_id names the item
        return []
    if int in kinds:
        if max(ident.bit_length() for ident in ids if type(ident) is int) > _MAX_ID_BITS:
            return []
        ids = [ident if ident is None else str(ident) for ident in ids]
    present = [ident for ident in ids if ident is not None] if type(None) in kinds else ids
    if max(map(len, present)) > MAX_ITEM_ID_CHARS or not all_storable(present):
        return []
    return ids


def check_item(cls: type[Model], index: int, item: object, settings: Settings) -> tuple[Any, str | None]:
    """One item's checked form (what the model's ``prepare`` takes) and its user id, or InvalidInput."""
    try:
        checked = cls.validate(index, item, settings)
    except InvalidInput:
        raise
    except MODEL_FAILURES as exc:  # a user model's check that breaks is its item's error, not the worker's
        raise InvalidInput(f"the model's check failed: {type(exc).__name__}: {exc}", index) from exc
    return checked, item_id(index, item)


def item_id(index: int, item: object) -> str | None:
    """The user's own id of an item (``{"id": ...}``), carried to the results: a string or an integer."""
    if not isinstance(item, dict) or item.get("id") is None:
        return None
    ident = item["id"]
    if isinstance(ident, bool) or not isinstance(ident, str | int):
        raise InvalidInput("field 'id' must be a string or an integer", index)
    if isinstance(ident, int) and ident.bit_length() > _MAX_ID_BITS:  # str() of a huge one raises, or crawls
        raise InvalidInput(f"field 'id' is an integer of over {MAX_ITEM_ID_CHARS} digits", index)
    ident = str(ident)
    if len(ident) > MAX_ITEM_ID_CHARS:
        raise InvalidInput(
            f"field 'id' has {len(ident)} characters, over the limit of {MAX_ITEM_ID_CHARS}", index
        )
    return check_text(ident, "field 'id'", index)


def job_id_of(value: object, name: str = "job_id") -> str:
    """A job id as batchwork makes them: a UUID in its canonical form (36 characters, lower case)."""
    if is_job_id(value):
        return value
    raise InvalidInput(f"{name} must be a UUID like {uuid.UUID(int=0)}, not {shown(value)}")


def expiry(deadline_s: object) -> float | None:
    """The Unix time ``deadline_s`` from now, for a job that must not start items later than that."""
    if deadline_s is None:
        return None
    if not _is_number(deadline_s) or not 0 < deadline_s < 10 * 365 * 86400:  # type: ignore[operator]
        raise InvalidInput("argument 'deadline_s' must be a positive number of seconds (at most ten years)")
    return time.time() + float(deadline_s)  # type: ignore[arg-type]


def _indices(value: object, count: int, total: int) -> list[int] | None:
    """A message's item indices: ``count`` distinct integers below ``total`` (None: consecutive ones)."""
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != count:
        raise InvalidInput(f"argument 'indices' must be a list of {count} job indices, one per item")
    if not all(type(index) is int and 0 <= index < total for index in value):
        raise InvalidInput(f"argument 'indices' must hold integers from 0 to {total - 1} (the job's total)")
    if len(set(value)) != count:
        raise InvalidInput("argument 'indices' names an item twice")
    return value


def _refuse_unknown(kwargs: Mapping[str, Any], known: Sequence[str]) -> None:
    unknown = [name for name in kwargs if name not in known]
    if unknown:
        names = ", ".join(shown(name, 40) for name in sorted(map(str, unknown))[:5])
        raise InvalidInput(f"unknown argument(s) {names}: expected {', '.join(known)}")


def _model(value: object, settings: Settings) -> str:
    model_class(value, settings)  # refuses anything not served here, before importing it
    return str(value)


def _inputs(value: object, settings: Settings) -> list[Any]:
    # A string is not a list of inputs: it would become one item per character.
    if isinstance(value, str | bytes | Mapping) or not isinstance(value, list | tuple):
        raise InvalidInput("argument 'inputs' must be a list of items (a single text goes in a list: [text])")
    if not value:
        raise InvalidInput("argument 'inputs' is empty")
    if len(value) > settings.max_items_per_job:
        raise InvalidInput(f"a job holds at most {settings.max_items_per_job} items, this one {len(value)}")
    return list(value)


def priority_of(value: object) -> str:
    """A call's priority (normal when none is given), or InvalidInput naming the ones there are."""
    if value is None:
        return "normal"
    if value not in PRIORITIES:
        raise InvalidInput(f"argument 'priority' must be one of {', '.join(PRIORITIES)}, not {shown(value)}")
    return str(value)


def _count(value: object, name: str) -> int:
    if not is_count(value):
        raise InvalidInput(
            f"argument '{name}' must be a non-negative integer (at most {MAX_COUNT}), not {shown(value)}"
        )
    return value


def _unix_time(value: object, name: str) -> float | None:
    if value is None:
        return None
    if not _is_number(value) or not 0 <= value <= LAST_UNIX_TIME:  # type: ignore[operator]
        raise InvalidInput(f"argument '{name}' must be a Unix time in seconds, not {shown(value)}")
    return float(value)  # type: ignore[arg-type]


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
