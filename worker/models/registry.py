"""Resolves a model name (a built-in like ``minilm``, a user's ``"package.module:Class"``, or a model kind
over a local checkpoint, ``"NAME=embed:/dir"``) to its class.

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
from worker.models.specs import BUILTIN_MODELS, MODEL_KINDS, ModelSpec, parse_model_entry

if TYPE_CHECKING:
    from worker.settings import Settings

# The catalogue and the entries' parsing live in worker/models/specs.py (settings read them without a model);
# named here too for the callers that resolve models.
__all__ = [
    "BUILTIN_MODELS",
    "MODEL_KINDS",
    "ModelDescription",
    "ModelSpec",
    "UnknownModel",
    "check_checkpoints",
    "model_class",
    "parse_model_entry",
    "served_models",
    "shown",
    "spec_class",
]


class UnknownModel(InvalidInput):
    """A model name this deployment does not serve, or an allowed path that is not a Model subclass."""


class ModelDescription(NamedTuple):
    name: str
    description: str
    max_batch_size: int
    max_wait_ms: float


def model_class(name: object, settings: Settings) -> type[Model]:
    """The class of a model this deployment serves; UnknownModel, with nothing imported, for any other."""
    spec = settings.served.get(name) if isinstance(name, str) else None
    if spec is None:
        raise UnknownModel(
            f"unknown model {shown(name)}: this deployment serves {', '.join(settings.served)} "
            "(BATCHWORK_MODELS lists them)"
        )
    cls = spec_class(spec)
    block = settings.model_options.get(spec.name)
    # A built-in's block was checked at settings load.
    if block is not None and spec.name not in BUILTIN_MODELS:
        try:
            cls.options_from(block)
        except ValueError as exc:  # its Options were unknown until now: a misspelt key is refused here
            raise UnknownModel(f"bad setting BATCHWORK_MODEL_OPTIONS: {exc}") from None
    return cls


def spec_class(spec: ModelSpec) -> type[Model]:
    """The class a served entry resolves to; for a model kind, a subclass named for the entry and bound to
    its checkpoint directory (made once per entry)."""
    if spec.kind is None:
        return _import_model(spec.target)
    return _kind_class(spec.target, spec.name, spec.kind, spec.checkpoint or "")


def check_checkpoints(settings: Settings, only: str | None = None) -> None:
    """Check the directory of every served model kind entry, or of ``only`` (SetupError, one line, for the
    first bad one)."""
    from worker.errors import SetupError

    for name, spec in settings.served.items():
        if spec.kind is not None and only in (None, name):
            cls = spec_class(spec)
            try:
                cls.options_from(settings.model_options.get(name, {}))
            except ValueError as exc:
                raise SetupError(f"BATCHWORK_MODEL_OPTIONS[{name!r}]: {exc}") from None
            cls.check_checkpoint()


def served_models(settings: Settings) -> list[ModelDescription | UnknownModel]:
    """One row per served model, for ``batchwork models``; a model that cannot be imported is its error."""
    rows: list[ModelDescription | UnknownModel] = []
    for name in settings.served:
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
def _kind_class(target: str, name: str, kind: str, checkpoint: str) -> type[Model]:
    base = _import_model(target)
    attributes = {"name": name, "kind": kind, "checkpoint": checkpoint, "__module__": base.__module__}
    return type(base.__name__, (base,), attributes)


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
