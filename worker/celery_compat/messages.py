"""kombu's ``Message``, told that it was acknowledged by other means.

Private thing: ``Message._state``, which ``Message.ack`` sets to ``"ACK"`` and ``Message.acknowledged`` reads.
The worker acks many messages in one round trip (the transport's ``QoS.ack_many``), never through each
message's ``ack`` (one round trip each). Each is marked as ``ack`` would mark it, so ``acknowledged``
stays true and nothing (Celery at shutdown, a later reject) acks or rejects it a second time (contract:
tests/unit/test_celery_compat.py).
"""

from __future__ import annotations

from typing import Any


def mark_acked(message: Any) -> None:
    """Record on ``message`` that the broker has forgotten it, as ``Message.ack`` would."""
    message._state = "ACK"
