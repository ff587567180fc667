"""A user's own model, named by import path ``tests.integration.echo_model:Echo`` in tests.

It must never need weights or torch: its output is a checkable function of its input.
"""

from __future__ import annotations

from collections.abc import Sequence

from worker.models.base import Model, Prepared, text_of


class Echo(Model):
    """Returns each item's text and its length in characters."""

    name = "echo"
    max_batch_size = 16
    max_wait_ms = 10.0

    def prepare(self, items: Sequence[object]) -> list[Prepared]:
        max_chars = self.settings.max_input_chars
        return [Prepared(text_of(index, item, max_chars)) for index, item in enumerate(items)]

    def forward(self, payloads: Sequence[str]) -> list[dict[str, object]]:
        return [{"echo": text, "n": len(text)} for text in payloads]
