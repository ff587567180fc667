"""Celery's task events sent in bulk, written by orjson.

Private things (contract: tests/unit/test_celery_compat.py):
- kombu's serializer ``registry.type_to_name``: registering an encoder for ``application/json`` also makes
  it the name kombu reads that content type under (and replies are sent under); the name kombu had is put
  back, so only the event dispatcher, which asks for the serializer by name, uses the new encoder.
- ``EventDispatcher.buffer_limit`` and ``.serializer``: set once at construction by Celery; the dispatcher
  reads them at every send, so the worker's dispatcher (made by Celery's consumer) is changed in place.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kombu.serialization import registry


def register_encoder(name: str, encode: Callable[[Any], str], content_type: str, encoding: str) -> None:
    """An encoder kombu knows as ``name``, writing ``content_type``; reading that type stays kombu's."""
    previous = registry.type_to_name.get(content_type)
    registry.register(name, encode, None, content_type, encoding)
    if previous is not None:
        registry.type_to_name[content_type] = previous


def send_in_bulk(dispatcher: Any, buffer_limit: int, serializer: str) -> None:
    """Make Celery's ``dispatcher`` buffer up to ``buffer_limit`` task events per message (a "task.multi",
    as Flower reads it) and write them with ``serializer``."""
    dispatcher.buffer_limit = max(dispatcher.buffer_limit, buffer_limit)
    dispatcher.serializer = serializer
