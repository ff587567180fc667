"""Resolves a model name (a built-in like ``minilm``, or a user's ``"package.module:Class"``) to its class.

It must never import torch or load weights: producers and the API resolve models only to validate inputs.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterable
from functools import cache
from typing import NamedTuple

from worker.models.base import InvalidInput, Model

# Import paths rather than classes, so a built-in's module is imported only when it is asked for.
BUILTIN_MODELS: dict[str, str] = {
    "gpt2": "worker.models.gpt2:GPT2",
    "minilm": "worker.models.minilm:MiniLM",
    "noop": "worker.models.noop:Noop",
    "simulated": "worker.models.simulated:Simulated",
}


class UnknownModel(InvalidInput):
    """A model name that is neither a built-in nor an importable Model subclass."""


class ModelDescription(NamedTuple):
    name: str
    description: str
    max_batch_size: int
    max_wait_ms: float


def model_names() -> list[str]:
    return sorted(BUILTIN_MODELS)


@cache
def model_class(name: str) -> type[Model]:
    """The class of a built-in model name or of an import path ``"package.module:ClassName"``."""
    if name in BUILTIN_MODELS:
        return _import_model(BUILTIN_MODELS[name])
    if ":" in name:
        return _import_model(name)
    known = ", ".join(model_names())
    raise UnknownModel(
        f"unknown model {name!r}: use one of {known}, or an import path 'package.module:ClassName'"
    )


def describe(names: Iterable[str] = ()) -> list[ModelDescription]:
    """One row per built-in model and per name in ``names`` (import paths too), for ``batchwork models``."""
    return [_description(name, model_class(name)) for name in sorted({*model_names(), *names})]


def _description(name: str, cls: type[Model]) -> ModelDescription:
    doc = inspect.getdoc(cls) or ""
    first_line = doc.splitlines()[0] if doc else ""
    return ModelDescription(name, first_line, cls.max_batch_size, cls.max_wait_ms)


def _import_model(path: str) -> type[Model]:
    module_name, _, class_name = path.partition(":")
    if not module_name or not class_name or ":" in class_name:
        raise UnknownModel(f"model {path!r}: an import path must look like 'package.module:ClassName'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UnknownModel(f"model {path!r}: cannot import module {module_name!r} ({exc})") from exc
    cls = getattr(module, class_name, None)
    if cls is None:
        raise UnknownModel(f"model {path!r}: module {module_name!r} has no attribute {class_name!r}")
    if not (isinstance(cls, type) and issubclass(cls, Model)):
        raise UnknownModel(f"model {path!r}: {class_name!r} is not a subclass of worker.models.base.Model")
    return cls
