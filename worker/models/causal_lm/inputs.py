"""Generation requests: the checks every item passes before it is queued, and the payload a checked one
becomes.

It must never import torch or a tokenizer: producers and the API run ``check_request`` on every item, so
it stays cheap. Token counts and chat templates are applied later, by ``CausalLM.prepare``, once a
tokenizer is loaded; here the checkpoint's JSON files alone bound what they can.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from worker.models.base import InvalidInput

FIELDS = ("prompt", "messages", "max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop", "id")
# Where no checkpoint can be read (a producer without the worker's files) the exact context is unknown;
# this bound only stops absurd values early, and the worker checks the real one in prepare.
UNKNOWN_CONTEXT_TOKENS = 1_000_000
# torch.Generator.manual_seed takes any unsigned 64-bit value.
MAX_SEED = 2**64 - 1
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 200
MAX_MESSAGES = 1_000


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
    """One item's checked fields, before tokenizing: a prompt, or chat messages ((role, content) pairs)."""

    prompt: str | None
    messages: tuple[tuple[str, str], ...] | None
    max_new_tokens: int
    sampling: Sampling
    stop: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Prompt:
    """The payload of one sequence: its prompt tokens and limits, or why it cannot run (``error``)."""

    token_ids: tuple[int, ...]
    max_new_tokens: int
    sampling: Sampling = Sampling()
    stop: tuple[str, ...] = ()
    error: str | None = None

    @property
    def kv_tokens(self) -> int:
        """The most cache this sequence can need: its prompt plus every token it may generate."""
        return len(self.token_ids) + self.max_new_tokens


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """What a checkpoint directory's JSON files say, read without loading anything."""

    context_tokens: int
    has_chat_template: bool


@cache
def read_checkpoint(directory: str | None) -> Checkpoint:
    """The context (config.json's max_position_embeddings or n_positions) and whether the tokenizer has a
    chat template; generous guesses when the files cannot be read (the worker's load reports those)."""
    if directory is None:
        return Checkpoint(UNKNOWN_CONTEXT_TOKENS, True)
    path = Path(directory)
    try:
        config = json.loads((path / "config.json").read_text())
        text_config = config.get("text_config") or config
        context = int(text_config.get("max_position_embeddings") or text_config["n_positions"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        context = UNKNOWN_CONTEXT_TOKENS
    return Checkpoint(context, _has_chat_template(path))


def _has_chat_template(path: Path) -> bool:
    if (path / "chat_template.jinja").is_file() or (path / "chat_template.json").is_file():
        return True
    try:
        return bool(json.loads((path / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return True  # unreadable here: prepare, with the tokenizer loaded, decides


def check_request(index: int, item: object, max_chars: int, checkpoint: Checkpoint) -> Request:
    """The checked fields of ``item``, or InvalidInput naming the item and the field."""
    if not isinstance(item, dict):
        raise InvalidInput(
            "expected an object with fields 'prompt' (or 'messages') and 'max_new_tokens'", index
        )
    unknown = sorted(str(name) for name in item if name not in FIELDS)
    if unknown:
        raise InvalidInput(f"unknown field {unknown[0]!r} (known: {', '.join(FIELDS)})", index)
    if "prompt" not in item and "messages" not in item:
        raise InvalidInput("missing field 'prompt' (or 'messages')", index)
    if "prompt" in item and "messages" in item:
        raise InvalidInput("give exactly one of 'prompt' and 'messages'", index)
    messages = None
    if "messages" in item:
        if not checkpoint.has_chat_template:
            raise InvalidInput(
                "field 'messages': the model's tokenizer has no chat template; send 'prompt'", index
            )
        messages = _messages(index, item["messages"], max_chars)
    return Request(
        prompt=None if messages is not None else _prompt(index, item, max_chars),
        messages=messages,
        max_new_tokens=_max_new_tokens(index, item, checkpoint.context_tokens),
        sampling=_sampling(index, item),
        stop=_stop(index, item),
    )


def _prompt(index: int, item: dict, max_chars: int) -> str:
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


def _messages(index: int, messages: object, max_chars: int) -> tuple[tuple[str, str], ...]:
    if not isinstance(messages, list) or not messages:
        raise InvalidInput("field 'messages' must be a non-empty list of {role, content} objects", index)
    if len(messages) > MAX_MESSAGES:
        raise InvalidInput(
            f"field 'messages' has {len(messages)} messages, over the limit of {MAX_MESSAGES}", index
        )
    checked, chars = [], 0
    for number, message in enumerate(messages):
        where = f"messages[{number}]"
        if not isinstance(message, dict) or set(message) != {"role", "content"}:
            raise InvalidInput(f"field '{where}' must be an object with exactly 'role' and 'content'", index)
        role, content = message["role"], message["content"]
        if not isinstance(role, str) or not role or not isinstance(content, str):
            raise InvalidInput(
                f"field '{where}': 'role' must be a non-empty string, 'content' a string", index
            )
        chars += len(content)
        checked.append((role, content))
    if chars > max_chars:
        raise InvalidInput(f"field 'messages' has {chars} characters, over the limit of {max_chars}", index)
    return tuple(checked)


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


def _stop(index: int, item: dict) -> tuple[str, ...]:
    stop = item.get("stop")
    if stop is None:
        return ()
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise InvalidInput("field 'stop' must be a list of non-empty strings", index)
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidInput(
            f"field 'stop' has {len(stop)} strings, over the limit of {MAX_STOP_STRINGS}", index
        )
    longest = max((len(s) for s in stop), default=0)
    if longest > MAX_STOP_CHARS:
        raise InvalidInput(f"field 'stop' has a string of {longest} characters, over {MAX_STOP_CHARS}", index)
    return tuple(stop)


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
