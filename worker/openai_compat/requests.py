"""OpenAI request bodies made into the items a batchwork model runs, checked by that model.

``/v1/embeddings`` bodies become one item per input text (the model's ``validate`` takes a string);
``/v1/completions`` one item per prompt, ``/v1/chat/completions`` one item with the messages, each as
``{"prompt" | "messages", "max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop"}``, the fields a
``generate`` model takes. ``noop`` serves every endpoint. A body that cannot run raises RequestError naming
the field.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from worker.errors import InvalidInput
from worker.models.base import Model
from worker.models.noop import Noop
from worker.models.registry import UnknownModel, model_class, shown

if TYPE_CHECKING:
    from worker.settings import Settings

EMBEDDINGS = "/v1/embeddings"
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
# The model kind each endpoint needs (worker.models.base.Model.kind).
ENDPOINT_KINDS = {EMBEDDINGS: "embed", COMPLETIONS: "generate", CHAT: "generate"}
# OpenAI's default max_tokens for /v1/completions; chat has no limit there, so ours is a bound we chose.
COMPLETION_DEFAULT_TOKENS = 16
CHAT_DEFAULT_TOKENS = 256
# OpenAI samples at temperature 1 when a body names none (batchwork's own default is greedy).
DEFAULT_TEMPERATURE = 1.0
MAX_INPUTS_PER_REQUEST = 2048  # OpenAI's bound on inputs of one embeddings request

_COMMON = ("model", "user", "n", "stream", "stream_options")
_SAMPLING = ("temperature", "top_p", "top_k", "seed", "stop")
FIELDS = {
    EMBEDDINGS: (*_COMMON, "input", "encoding_format", "dimensions"),
    COMPLETIONS: (*_COMMON, *_SAMPLING, "prompt", "max_tokens"),
    CHAT: (*_COMMON, *_SAMPLING, "messages", "max_tokens", "max_completion_tokens"),
}

_ALLOWED = {endpoint: frozenset(names) for endpoint, names in FIELDS.items()}

# Detokenizes a token array for a model (None: the model has no tokenizer batchwork can read).
Detokenizer = Callable[[type[Model], list[int]], str | None]


class RequestError(ValueError):
    """A request body that cannot run: OpenAI's error ``code`` and ``param``, and one line saying why."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


@dataclass(slots=True)  # not frozen: one is made per line of a file, and a frozen one costs 3x to make
class Request:
    """One request: the model, the items it runs, and what shapes the answer (never changed once made)."""

    endpoint: str
    model: str
    items: list[Any]
    encoding_format: str = "float"
    dimensions: int | None = None
    texts: list[str] = field(default_factory=list)  # embeddings: the input texts, for usage


def serves_endpoint(cls: type[Model], endpoint: str) -> bool:
    """Can this model answer ``endpoint``? Its kind must be the endpoint's; noop answers every one."""
    return issubclass(cls, Noop) or cls.kind == ENDPOINT_KINDS[endpoint]


def parse_request(
    endpoint: str,
    body: object,
    settings: Settings,
    detokenize: Detokenizer | None = None,
    check: bool = True,
    classes: dict[tuple[str, str], type[Model]] | None = None,
) -> Request:
    """The request ``body`` of ``endpoint`` as checked items of its model; RequestError otherwise.
    ``check=False`` skips the model's own check of each item (a file read again after it passed)."""
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object", "body")
    if not body.keys() <= _ALLOWED[endpoint]:
        unknown = sorted(str(name) for name in body if name not in _ALLOWED[endpoint])
        raise RequestError(f"unsupported field {shown(unknown[0], 60)} for {endpoint}", unknown[0])
    cls = _cached_model(body.get("model"), endpoint, settings, classes)
    if "n" in body or "stream" in body:
        _only_default(body, "n", 1, "only n=1 is served")
        _only_default(body, "stream", False, "streaming is not served here")
    if endpoint == EMBEDDINGS:
        request = _embeddings(body, cls, detokenize)
    else:
        request = _generation(endpoint, body, cls)
    if check:
        _check_items(cls, request.items, settings)
    return request


def _cached_model(
    name: object, endpoint: str, settings: Settings, classes: dict[tuple[str, str], type[Model]] | None
) -> type[Model]:
    """``_model``, remembered in ``classes`` (one batch file's lines name few models, many times)."""
    if classes is None or not isinstance(name, str):
        return model_for(name, endpoint, settings)
    cls = classes.get((name, endpoint))
    if cls is None:
        cls = classes[(name, endpoint)] = model_for(name, endpoint, settings)
    return cls


def model_for(name: object, endpoint: str, settings: Settings) -> type[Model]:
    """The model class ``name`` that serves ``endpoint``; RequestError naming why not."""
    if name is None:
        raise RequestError("missing field 'model'", "model")
    try:
        cls = model_class(name, settings)
    except UnknownModel as exc:
        raise RequestError(str(exc), "model", "model_not_found") from None
    if not serves_endpoint(cls, endpoint):
        kind, needed = cls.kind or "no kind", ENDPOINT_KINDS[endpoint]
        raise RequestError(
            f"model {shown(name)} ({kind}) cannot serve {endpoint}: it needs a {needed} model",
            "model",
            "model_not_supported",
        )
    return cls


def _only_default(body: dict[str, Any], name: str, default: object, why: str) -> None:
    value = body.get(name)
    if value is not None and value != default:
        raise RequestError(f"field '{name}': {why}", name)


def _embeddings(body: dict[str, Any], cls: type[Model], detokenize: Detokenizer | None) -> Request:
    texts = _input_texts(body.get("input"), cls, detokenize)
    encoding = body.get("encoding_format")
    if encoding is None:
        encoding = "float"
    if encoding not in ("float", "base64"):
        raise RequestError("field 'encoding_format' must be 'float' or 'base64'", "encoding_format")
    dimensions = body.get("dimensions")
    if dimensions is not None:
        if not _is_int(dimensions) or dimensions < 1:
            raise RequestError("field 'dimensions' must be a positive integer", "dimensions")
        full = getattr(cls, "dimension", None)
        if isinstance(full, int) and dimensions > full:
            raise RequestError(f"field 'dimensions' is {dimensions}, over the model's {full}", "dimensions")
    name = str(body["model"])
    return Request(EMBEDDINGS, name, texts, str(encoding), dimensions, texts)  # the one list, never changed


def _input_texts(value: object, cls: type[Model], detokenize: Detokenizer | None) -> list[str]:
    """A string, a list of strings, a token array or a list of token arrays, as texts."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value:
        raise RequestError("field 'input' must be a string, a list of strings or token arrays", "input")
    if len(value) > MAX_INPUTS_PER_REQUEST:
        raise RequestError(f"field 'input' holds {len(value)} inputs, over {MAX_INPUTS_PER_REQUEST}", "input")
    if all(isinstance(text, str) for text in value):
        return list(value)
    if all(_is_int(token) for token in value):
        return [_detokenized(value, cls, detokenize)]
    if all(isinstance(tokens, list) and tokens and all(map(_is_int, tokens)) for tokens in value):
        return [_detokenized(tokens, cls, detokenize) for tokens in value]
    raise RequestError("field 'input' must be a string, a list of strings or token arrays", "input")


def _detokenized(tokens: list[int], cls: type[Model], detokenize: Detokenizer | None) -> str:
    if issubclass(cls, Noop):
        return "tokens"
    text = None if detokenize is None else detokenize(cls, tokens)
    if text is None:
        raise RequestError(f"model {cls.name!r} takes no token arrays here: send text", "input")
    return text


def _generation(endpoint: str, body: dict[str, Any], cls: type[Model]) -> Request:
    noop = issubclass(cls, Noop)
    name = str(body["model"])
    if endpoint == COMPLETIONS:
        prompts = _prompts(body.get("prompt"))
        limit = _max_tokens(body, ("max_tokens",), COMPLETION_DEFAULT_TOKENS)
        if noop:
            return Request(endpoint, name, [_noop_text(prompt) for prompt in prompts])
        return Request(endpoint, name, [{"prompt": p, **_sampling(body, limit)} for p in prompts])
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("field 'messages' must be a non-empty list of messages", "messages")
    limit = _max_tokens(body, ("max_completion_tokens", "max_tokens"), CHAT_DEFAULT_TOKENS)
    if noop:
        last = messages[-1].get("content") if isinstance(messages[-1], dict) else None
        return Request(endpoint, name, [_noop_text(last)])
    return Request(endpoint, name, [{"messages": messages, **_sampling(body, limit)}])


def _prompts(value: object) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(prompt, str) for prompt in value):
        return list(value)
    raise RequestError("field 'prompt' must be a string or a list of strings", "prompt")


def _max_tokens(body: dict[str, Any], names: Sequence[str], default: int) -> int:
    for name in names:
        value = body.get(name)
        if value is not None:
            if not _is_int(value) or value < 1:
                raise RequestError(f"field '{name}' must be a positive integer", name)
            return int(value)
    return default


def _sampling(body: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    fields: dict[str, Any] = {"max_new_tokens": max_tokens}
    temperature = body.get("temperature")
    fields["temperature"] = DEFAULT_TEMPERATURE if temperature is None else temperature
    for name in ("top_p", "top_k", "seed"):
        if body.get(name) is not None:
            fields[name] = body[name]
    stop = body.get("stop")
    if stop is not None:
        fields["stop"] = [stop] if isinstance(stop, str) else stop
    return fields


def _noop_text(text: object) -> str:
    """noop checks its items as texts; a generation request gives it its prompt (or a placeholder)."""
    return text if isinstance(text, str) and text.strip() else "."


def _check_items(cls: type[Model], items: list[Any], settings: Settings) -> None:
    for position, item in enumerate(items):
        try:
            cls.validate(position, item, settings)
        except InvalidInput as exc:
            raise RequestError(exc.detail, _param(exc.detail)) from None
        except Exception as exc:  # a model's check that breaks is this request's error
            raise RequestError(f"the model's check failed: {type(exc).__name__}: {exc}") from None


def _param(detail: str) -> str | None:
    """The field an error names (``field 'x' ...``), if it names one."""
    start = detail.find("'")
    end = detail.find("'", start + 1)
    return detail[start + 1 : end] if 0 <= start < end else None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
