"""Test models that fail on purpose, named by import path: a poison input, and out-of-memory above a size."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from worker.models.base import Model, text_of


class Poison(Model):
    """Echoes each text's length, but a batch holding the text "poison" raises, like a crashing tokenizer."""

    name = "poison"
    max_batch_size = 32
    max_wait_ms = 20

    def forward(self, payloads: Sequence[Any]) -> list[int]:
        texts = [text_of(0, item, 10**6) for item in payloads]
        if "poison" in texts:
            raise ValueError("cannot digest 'poison'")
        return [len(text) for text in texts]


class OutOfMemoryAbove16(Model):
    """Raises torch's CUDA out-of-memory error for any batch of more than 16 items."""

    name = "oom16"
    max_batch_size = 64
    max_wait_ms = 20

    def forward(self, payloads: Sequence[Any]) -> list[int]:
        import torch

        if len(payloads) > 16:
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {len(payloads)} GiB")
        return [len(text_of(0, item, 10**6)) for item in payloads]
