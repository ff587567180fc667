"""Model outputs made into OpenAI response bodies: an embeddings list, a text_completion, a chat.completion.

Embedding outputs are lists of floats (noop's 0 is a one-element zero vector); ``dimensions`` keeps the first
d numbers and renormalizes them to unit length; ``base64`` is the float32 little-endian bytes, as OpenAI
sends them. Generation outputs are ``{"text", "tokens", "finish_reason", "prompt_tokens"}``.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import orjson

from worker.openai_compat.requests import CHAT, EMBEDDINGS, Request

# batchwork's finish reasons as OpenAI names them.
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}

# noop's output 0 as an embedding, already encoded.
ZERO_VECTOR = orjson.Fragment(b"[0.0]")
# Counts the tokens of texts for ``usage`` (None: unknown, counted as 0).
TokenCounter = Callable[[list[str]], list[int]] | None


class RawJson:
    """A stored output still as its JSON text: a float embedding goes into the answer as it is, never decoded
    and encoded again (the largest cost of a batch's output file)."""

    __slots__ = ("text",)

    def __init__(self, text: str | bytes) -> None:
        self.text = text

    def value(self) -> Any:
        return orjson.loads(self.text)


def decoded(output: Any) -> Any:
    return output.value() if isinstance(output, RawJson) else output


class OutputError(ValueError):
    """An output that cannot become the answer asked for (``dimensions`` over the vector's length)."""


def response_body(
    request: Request, outputs: Sequence[Any], response_id: str, count_tokens: TokenCounter = None
) -> dict[str, Any]:
    """The OpenAI response body of ``request`` from its items' outputs, in item order."""
    if request.endpoint == EMBEDDINGS:
        return embeddings_body(request, outputs, count_tokens)
    return completion_body(request, outputs, response_id)


def embeddings_body(request: Request, outputs: Sequence[Any], count_tokens: TokenCounter) -> dict[str, Any]:
    data = [
        {"object": "embedding", "index": index, "embedding": encode_vector(request, output)}
        for index, output in enumerate(outputs)
    ]
    tokens = sum(count_tokens(request.texts)) if count_tokens is not None else 0
    return {
        "object": "list",
        "data": data,
        "model": request.model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


def encode_vector(request: Request, output: Any) -> Any:
    plain = request.encoding_format == "float" and request.dimensions is None
    if isinstance(output, RawJson):
        if plain:
            return ZERO_VECTOR if output.text in ("0", b"0") else orjson.Fragment(output.text)
        output = output.value()
    if plain and isinstance(output, list):
        return output
    vector = np.asarray([0.0] if output == 0 else output, dtype=np.float32).reshape(-1)
    if request.dimensions is not None:
        if request.dimensions > vector.size:
            raise OutputError(f"dimensions {request.dimensions} is over the model's {vector.size}")
        vector = vector[: request.dimensions]
        norm = float(np.linalg.norm(vector))
        if norm > 0:
            vector = vector / norm
    if request.encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return [float(x) for x in vector.tolist()]


def completion_body(request: Request, outputs: Sequence[Any], response_id: str) -> dict[str, Any]:
    choices = []
    prompt_tokens = completion_tokens = 0
    for index, output in enumerate(outputs):
        text, tokens, finish, prompt = _generated(decoded(output))
        prompt_tokens += prompt
        completion_tokens += tokens
        if request.endpoint == CHAT:
            message = {"role": "assistant", "content": text, "refusal": None}
            choices.append({"index": index, "message": message, "logprobs": None, "finish_reason": finish})
        else:
            choices.append({"index": index, "text": text, "logprobs": None, "finish_reason": finish})
    chat = request.endpoint == CHAT
    return {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{response_id}",
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": request.model,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def _generated(output: Any) -> tuple[str, int, str, int]:
    """(text, tokens, finish_reason, prompt_tokens) of a generation output (noop's 0: an empty one)."""
    if isinstance(output, dict):
        text = output.get("text")
        tokens = output.get("tokens")
        prompt = output.get("prompt_tokens")
        finish = FINISH_REASONS.get(str(output.get("finish_reason")), "stop")
        return (
            text if isinstance(text, str) else "",
            _count(tokens),
            finish,
            _count(prompt),
        )
    if output == 0:
        return "", 0, "stop", 0
    return str(output), 0, "stop", 0


def _count(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def error_object(error: str) -> tuple[int | None, dict[str, Any]]:
    """An item's stored error as (HTTP status, OpenAI error) for a batch's error line; status None when the
    request never ran (cancelled or expired: OpenAI's ``batch_cancelled`` / ``batch_expired`` codes)."""
    kind = error.split(":", 1)[0]
    if kind == "cancelled":
        return None, {"code": "batch_cancelled", "message": "the batch was cancelled before this request ran"}
    if kind == "expired":
        message = "this request could not be executed before the completion window expired"
        return None, {"code": "batch_expired", "message": message}
    if kind == "invalid input":
        return 400, {"message": error, "type": "invalid_request_error", "param": None, "code": None}
    return 500, {"message": error, "type": "server_error", "param": None, "code": None}
