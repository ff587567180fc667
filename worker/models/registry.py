"""Resolves a model name (a built-in like ``minilm``, or a user's ``"package.module:Class"``) to its class.

Only names in the deployment's allow-list (``BATCHWORK_MODELS``) are ever imported: anything else is refused
before any import, so no caller can make a producer or a worker run a module's import-time code. It must
never import torch or load weights: producers and the API resolve models only to validate inputs.
"""

from __future__ import annotations

import importlib
import inspect
from functools import cache
from typing import TYPE_CHECKING, NamedTuple

from worker.models.base import InvalidInput, Model

if TYPE_CHECKING:
    from worker.settings import Settings

# The models batchwork ships; a deployment serves all of them unless BATCHWORK_MODELS says otherwise.
# Import paths rather than classes, so a built-in's module is imported only when it is asked for.
BUILTIN_MODELS: dict[str, str] = {
    "gpt2": "worker.models.gpt2:GPT2",
    "minilm": "worker.models.minilm:MiniLM",
    "noop": "worker.models.noop:Noop",
    "simulated": "worker.models.simulated:Simulated",
}


class UnknownModel(InvalidInput):
    """A model name this deployment does not serve, or an allowed path that is not a Model subclass."""


class ModelDescription(NamedTuple):
    name: str
    description: str
    max_batch_size: int
    max_wait_ms: float


def model_class(name: object, settings: Settings) -> type[Model]:
    """The class of a model this deployment serves; UnknownModel, with nothing imported, for any other."""
    if not isinstance(name, str) or name not in settings.models:
        raise UnknownModel(
            f"unknown model {shown(name)}: this deployment serves {', '.join(settings.models)} "
            "(BATCHWORK_MODELS lists them)"
        )
    cls = _import_model(BUILTIN_MODELS.get(name, name))
    block = settings.model_options.get(name)
    if block is not None and name not in BUILTIN_MODELS:  # a built-in's block was checked at settings load
        try:
            cls.options_from(block)
        except ValueError as exc:  # its Options were unknown until now: a misspelt key is refused here
            raise UnknownModel(f"bad setting BATCHWORK_MODEL_OPTIONS: {exc}") from None
    return cls


def builtin_model_class(name: str) -> type[Model]:
    """The class of a built-in model (settings check their option blocks with it; no weights load)."""
    return _import_model(BUILTIN_MODELS[name])


def served_models(settings: Settings) -> list[ModelDescription | UnknownModel]:
    """One row per served model, for ``batchwork models``; a model that cannot be imported is its error."""
    rows: list[ModelDescription | UnknownModel] = []
    for name in settings.models:
        try:
            rows.append(_description(name, model_class(name, settings)))
        except UnknownModel as exc:
            rows.append(exc)
    return rows


def shown(value: object, limit: int = 80) -> str:
    """A caller's value as it may appear in a message: repr, cut to ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def _description(name: str, cls: type[Model]) -> ModelDescription:
    doc = inspect.getdoc(cls) or ""
    first_line = doc.splitlines()[0] if doc else ""
    return ModelDescription(name, first_line, cls.max_batch_size, cls.max_wait_ms)


@cache
def _import_model(path: str) -> type[Model]:
    module_name, _, class_name = path.partition(":")
    if not module_name or not class_name or ":" in class_name:
        raise UnknownModel(f"model {shown(path)}: an import path must look like 'package.module:ClassName'")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # an allowed module that fails to import is a deployment error, said in one line
        raise UnknownModel(f"model {path!r}: cannot import module {module_name!r} ({exc})") from exc
    cls = getattr(module, class_name, None)
    if cls is None:
        raise UnknownModel(f"model {path!r}: module {module_name!r} has no attribute {class_name!r}")
    if not (isinstance(cls, type) and issubclass(cls, Model)):
        raise UnknownModel(f"model {path!r}: {class_name!r} is not a subclass of worker.models.base.Model")
    return cls
