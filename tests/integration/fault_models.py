"""Test models that fail on purpose, named by import path: a poison input, and out-of-memory above a size."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from worker.models.base import Model


class Poison(Model):
    """Echoes each text's length, but a batch holding the text "poison" raises, like a crashing tokenizer."""

    name = "poison"
    max_batch_size = 32
    max_wait_ms = 20

    def forward(self, payloads: Sequence[Any]) -> list[int]:
        if "poison" in payloads:
            raise ValueError("cannot digest 'poison'")
        return [len(text) for text in payloads]


class OutOfMemoryAbove16(Model):
    """Raises torch's CUDA out-of-memory error for any batch of more than 16 items."""

    name = "oom16"
    max_batch_size = 64
    max_wait_ms = 20

    def forward(self, payloads: Sequence[Any]) -> list[int]:
        import torch

        if len(payloads) > 16:
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {len(payloads)} GiB")
        return [len(text) for text in payloads]


class Crash(Model):
    """Kills its own worker process (as a segfault or the OOM killer would) on the text "crash"; else echoes
    each text's length."""

    name = "crash"
    max_batch_size = 8
    max_wait_ms = 20

    def forward(self, payloads: Sequence[Any]) -> list[int]:
        if "crash" in payloads:
            os._exit(9)
        return [len(text) for text in payloads]
