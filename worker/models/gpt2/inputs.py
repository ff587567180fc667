"""GPT-2 requests: the checks every item passes before it is queued, and the payload a checked one becomes.

It must never import torch or a tokenizer: producers and the API run ``check_request`` on every item, so
it stays cheap. Token counts are checked later, by ``GPT2.prepare``, once a tokenizer is loaded.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from worker.models.base import InvalidInput

FIELDS = ("prompt", "max_new_tokens", "temperature", "top_k", "top_p", "seed", "id")
# Where no checkpoint is configured (a producer without the worker's settings) the exact context is unknown;
# this bound only stops absurd values early, and the worker checks the real one in prepare.
UNKNOWN_CONTEXT_TOKENS = 1_000_000
# torch.Generator.manual_seed takes any unsigned 64-bit value.
MAX_SEED = 2**64 - 1


@dataclass(frozen=True, slots=True)
class Sampling:
    """How the next token is chosen: temperature 0 is greedy (argmax) and ignores the other fields."""

    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0  # 1: no nucleus filter
    seed: int | None = None  # None with temperature > 0: a fresh random seed

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True, slots=True)
class Request:
    """One item's checked fields, before tokenizing."""

    prompt: str
    max_new_tokens: int
    sampling: Sampling


@dataclass(frozen=True, slots=True)
class Prompt:
    """The payload of one sequence: its prompt tokens and limits, or why it cannot run (``error``)."""

    token_ids: tuple[int, ...]
    max_new_tokens: int
    sampling: Sampling = Sampling()
    error: str | None = None

    @property
    def kv_tokens(self) -> int:
        """The most cache this sequence can need: its prompt plus every token it may generate."""
        return len(self.token_ids) + self.max_new_tokens


@cache
def context_tokens(checkpoint: str | None) -> int:
    """``n_positions`` of the checkpoint's config.json, or a generous bound when there is none to read."""
    if checkpoint is None:
        return UNKNOWN_CONTEXT_TOKENS
    try:
        config = json.loads((Path(checkpoint) / "config.json").read_text())
        return int(config["n_positions"])
    except (OSError, ValueError, KeyError, TypeError):
        # Producers cannot always read the worker's checkpoint; the worker's load reports a broken one.
        return UNKNOWN_CONTEXT_TOKENS


def check_request(index: int, item: object, max_chars: int, context: int) -> Request:
    """The checked fields of ``item``, or InvalidInput naming the item and the field."""
    if not isinstance(item, dict):
        raise InvalidInput("expected an object with fields 'prompt' and 'max_new_tokens'", index)
    unknown = sorted(str(name) for name in item if name not in FIELDS)
    if unknown:
        raise InvalidInput(f"unknown field {unknown[0]!r} (known: {', '.join(FIELDS)})", index)
    return Request(
        prompt=_prompt(index, item, max_chars),
        max_new_tokens=_max_new_tokens(index, item, context),
        sampling=_sampling(index, item),
    )


def _prompt(index: int, item: dict, max_chars: int) -> str:
    if "prompt" not in item:
        raise InvalidInput("missing field 'prompt'", index)
    prompt = item["prompt"]
    if not isinstance(prompt, str):
        raise InvalidInput("field 'prompt' must be a string", index)
    if not prompt.strip():
        raise InvalidInput("field 'prompt' is empty", index)
    if len(prompt) > max_chars:
        raise InvalidInput(
            f"field 'prompt' has {len(prompt)} characters, over the limit of {max_chars}", index
        )
    return prompt


def _max_new_tokens(index: int, item: dict, context: int) -> int:
    if "max_new_tokens" not in item:
        raise InvalidInput("missing field 'max_new_tokens'", index)
    value = _integer(index, item, "max_new_tokens")
    if value < 1:
        raise InvalidInput(f"field 'max_new_tokens' must be at least 1, not {value}", index)
    if value > context:
        raise InvalidInput(
            f"field 'max_new_tokens' is {value}, over the model's context of {context} tokens", index
        )
    return value


def _sampling(index: int, item: dict) -> Sampling:
    temperature = _number(index, item, "temperature", 0.0)
    if temperature < 0:
        raise InvalidInput(f"field 'temperature' must be 0 (greedy) or more, not {temperature}", index)
    top_p = _number(index, item, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise InvalidInput(f"field 'top_p' must be more than 0 and at most 1, not {top_p}", index)
    top_k = _integer(index, item, "top_k", 0)
    if top_k < 0:
        raise InvalidInput(f"field 'top_k' must be 0 (no limit) or more, not {top_k}", index)
    seed = None if item.get("seed") is None else _integer(index, item, "seed", 0)
    if seed is not None and not 0 <= seed <= MAX_SEED:
        raise InvalidInput(f"field 'seed' must be between 0 and 2**64-1, not {seed}", index)
    return Sampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)


def _integer(index: int, item: dict, name: str, default: int = 0) -> int:
    value = item.get(name, default)
    # bool is an int in Python, but "max_new_tokens": true is a mistake, not 1.
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidInput(f"field {name!r} must be an integer, not {_kind(value)}", index)
    return value


def _number(index: int, item: dict, name: str, default: float) -> float:
    value = item.get(name, default)
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise InvalidInput(f"field {name!r} must be a finite number, not {_kind(value)}", index)
    return float(value)


def _kind(value: object) -> str:
    return repr(value) if isinstance(value, bool | float) or value is None else type(value).__name__
