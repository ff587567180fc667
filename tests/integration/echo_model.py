"""A user's own model, named by import path ``tests.integration.echo_model:Echo`` in tests.

It must never need weights or torch: its output is a checkable function of its input.
"""

from __future__ import annotations

from collections.abc import Sequence

from worker.models.base import Model


class Echo(Model):
    """Returns each item's text and its length in characters."""

    name = "echo"
    max_batch_size = 16
    max_wait_ms = 10.0

    def forward(self, payloads: Sequence[str]) -> list[dict[str, object]]:
        return [{"echo": text, "n": len(text)} for text in payloads]
