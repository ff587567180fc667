"""The task message a producer writes by hand: Celery's message protocol 2, in kombu's Redis envelope.

Private things (contract: tests/unit/test_celery_compat.py): the headers Celery's ``amqp.as_task_v2`` writes
and a worker reads, the body ``[args, kwargs, embed]``, and the JSON kombu's Redis channel pushes to a queue
list (body base64-encoded, the delivery info in the properties). Celery's own publish path costs a producer
about as much as the whole Redis round trip, so the producer writes the same bytes directly; any Celery
worker can read them. Nothing here checks a call or talks to Redis.
"""

from __future__ import annotations

import base64
import uuid
from typing import Any

import orjson

# The body's third part (protocol 2's "embed"): no callbacks, errbacks, chain or chord.
_EMBED = b'{"callbacks":null,"errbacks":null,"chain":null,"chord":null}'


def task_message(
    task_name: str, task_id: str, queue: str, kwargs: bytes, *, kwargsrepr: str, origin: str
) -> bytes:
    """The message kombu's Redis channel would push to ``queue`` for Celery's ``apply_async`` of
    ``task_name`` with no args and ``kwargs`` (their JSON object, as bytes), ignoring its result."""
    body = b"[[]," + kwargs + b"," + _EMBED + b"]"
    headers: dict[str, Any] = {
        "lang": "py",
        "task": task_name,
        "id": task_id,
        "shadow": None,
        "eta": None,
        "expires": None,
        "group": None,
        "group_index": None,
        "retries": 0,
        "timelimit": [None, None],
        "root_id": task_id,
        "parent_id": None,
        "argsrepr": "()",
        "kwargsrepr": kwargsrepr,
        "origin": origin,
        "ignore_result": True,
        "replaced_task_nesting": 0,
        "stamped_headers": None,
        "stamps": {},
    }
    properties = {
        "correlation_id": task_id,
        "reply_to": None,
        "delivery_mode": 2,
        "delivery_info": {"exchange": "", "routing_key": queue},
        "priority": 0,
        "body_encoding": "base64",
        "delivery_tag": str(uuid.uuid4()),
    }
    return orjson.dumps(
        {
            "body": base64.b64encode(body).decode(),
            "content-encoding": "utf-8",
            "content-type": "application/json",
            "headers": headers,
            "properties": properties,
        }
    )
