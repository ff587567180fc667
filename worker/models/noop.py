"""A model that does nothing, instantly: it measures batchwork's own overhead per item.

It must never sleep, load weights or depend on its input beyond validation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from worker.models.base import Model


class Noop(Model):
    """Returns 0 for every item at once; for measuring the system's overhead."""

    name = "noop"
    # Nothing to amortize, so batches are as large as the queue allows and barely wait.
    max_batch_size = 1024
    max_wait_ms = 5.0

    def forward(self, payloads: Sequence[Any]) -> list[int]:
        return [0] * len(payloads)
