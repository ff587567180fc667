"""What one `batchwork.infer` message asks for, checked the same way by producers and workers.

Producers refuse a bad call before anything is enqueued; the worker checks again (a raw Celery
call can skip the producer) and turns what fails into stored errors. No Celery or torch here.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from worker.models.base import InvalidInput
from worker.models.registry import model_class
from worker.settings import PRIORITIES, Settings

TASK_NAME = "batchwork.infer"


@dataclass(frozen=True, slots=True)
class InferCall:
    """One message: items ``offset .. offset+len(inputs)-1`` of job ``job_id`` (of ``total`` items)."""

    job_id: str
    model: str
    inputs: Sequence[Any]
    priority: str = "normal"
    offset: int = 0
    total: int = 0
    expires_at: float | None = None  # Unix time after which items not yet started end as expired

    def kwargs(self) -> dict[str, Any]:
        kwargs = {
            "model": self.model,
            "inputs": list(self.inputs),
            "priority": self.priority,
            "job_id": self.job_id,
            "offset": self.offset,
            "total": self.total,
        }
        if self.expires_at is not None:
            kwargs["expires_at"] = self.expires_at
        return kwargs


def parse_call(job_id: str, kwargs: Mapping[str, Any], settings: Settings) -> InferCall:
    """The call a message carries; InvalidInput for anything but the items themselves."""
    unknown = set(kwargs) - {"model", "inputs", "priority", "job_id", "offset", "total", "expires_at"}
    if unknown:
        raise InvalidInput(f"unknown argument(s): {', '.join(sorted(unknown))}")
    model = kwargs.get("model")
    if not isinstance(model, str):
        raise InvalidInput("argument 'model' must be a model name")
    model_class(model)
    inputs = kwargs.get("inputs")
    if not isinstance(inputs, list):
        raise InvalidInput("argument 'inputs' must be a list")
    if not inputs:
        raise InvalidInput("argument 'inputs' is empty")
    priority = kwargs.get("priority") or "normal"
    if priority not in PRIORITIES:
        raise InvalidInput(f"argument 'priority' must be one of {', '.join(PRIORITIES)}, not {priority!r}")
    offset = _count(kwargs.get("offset", 0), "offset")
    total = _count(kwargs.get("total") or offset + len(inputs), "total")
    if total > settings.max_items_per_job:
        raise InvalidInput(f"a job holds at most {settings.max_items_per_job} items, this one {total}")
    if offset + len(inputs) > total:
        raise InvalidInput(
            f"items {offset}..{offset + len(inputs) - 1} lie beyond the job's total of {total}"
        )
    expires_at = kwargs.get("expires_at")
    if expires_at is not None and (not isinstance(expires_at, int | float) or isinstance(expires_at, bool)):
        raise InvalidInput("argument 'expires_at' must be a Unix time in seconds")
    return InferCall(str(kwargs.get("job_id") or job_id), model, inputs, priority, offset, total, expires_at)


def expiry(deadline_s: float | None) -> float | None:
    """The Unix time ``deadline_s`` from now, for a job that must not start items later than that."""
    if deadline_s is None:
        return None
    if not isinstance(deadline_s, int | float) or isinstance(deadline_s, bool) or deadline_s <= 0:
        raise InvalidInput("argument 'deadline_s' must be a positive number of seconds")
    return time.time() + deadline_s


def check_items(call: InferCall, settings: Settings) -> None:
    """Raise InvalidInput naming the first item the model cannot take (producer side)."""
    validate = model_class(call.model).validate
    for position, item in enumerate(call.inputs):
        validate(call.offset + position, item, settings.max_input_chars)


def _count(value: object, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidInput(f"argument '{name}' must be a non-negative integer")
    return value
