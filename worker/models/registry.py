"""Resolves a model name (a built-in like ``minilm``, a user's ``"package.module:Class"``, or a model kind
over a local checkpoint, ``"NAME=embed:/dir"``) to its class.

Only names in the deployment's allow-list (``BATCHWORK_MODELS``) are ever imported: anything else is refused
before any import, so no caller can make a producer or a worker run a module's import-time code. It must
never import torch or load weights: producers and the API resolve models only to validate inputs.
"""

from __future__ import annotations

import importlib
import inspect
import re
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, NamedTuple

from worker.bounds import MAX_MODEL_NAME_CHARS
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
# Model kinds over a local checkpoint directory: a BATCHWORK_MODELS entry "NAME=KIND:/dir" serves the
# checkpoint in /dir under NAME; "KIND:/dir" alone serves it under that very string (the embedded run's
# `--model embed:/dir`). Each kind's class reads its directory from its ``checkpoint`` class attribute.
MODEL_KINDS: dict[str, str] = {
    "embed": "worker.models.encoders:Embedder",
    "classify": "worker.models.encoders:Classifier",
    "generate": "worker.models.causal_lm:CausalLM",
}


class UnknownModel(InvalidInput):
    """A model name this deployment does not serve, or an allowed path that is not a Model subclass."""


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """One entry of BATCHWORK_MODELS: the name callers use, the class it resolves to (an import path),
    and for a model kind its checkpoint directory."""

    name: str
    target: str
    kind: str | None = None
    checkpoint: str | None = None


def parse_model_entry(entry: str) -> ModelSpec:
    """A BATCHWORK_MODELS entry as a ModelSpec; ValueError (one line) for anything else."""
    spec = _parse_entry(entry)
    if len(spec.name) > MAX_MODEL_NAME_CHARS:
        raise ValueError(f"model names are at most {MAX_MODEL_NAME_CHARS} characters: {spec.name[:40]!r}...")
    return spec


def _parse_entry(entry: str) -> ModelSpec:
    if entry in BUILTIN_MODELS:
        return ModelSpec(entry, BUILTIN_MODELS[entry])
    name, equals, rest = entry.partition("=")
    spec = rest if equals else entry
    kind, colon, directory = spec.partition(":")
    if colon and kind in MODEL_KINDS:
        if equals and not _NAME.match(name):
            raise ValueError(f"{entry!r}: a model name is letters, digits and . _ - (before the '=')")
        if not directory:
            raise ValueError(f"{entry!r}: {kind}: needs a checkpoint directory, e.g. {kind}:/models/mine")
        return ModelSpec(name if equals else entry, MODEL_KINDS[kind], kind, directory)
    if not equals and _MODEL_PATH.fullmatch(entry):
        return ModelSpec(entry, entry)
    raise ValueError(
        f"{entry!r} is neither a built-in model ({', '.join(sorted(BUILTIN_MODELS))}), an import path "
        f"'package.module:ClassName', nor a checkpoint 'NAME=KIND:/dir' (kinds: {', '.join(MODEL_KINDS)})"
    )


# An import path: dotted module, one colon, a class name. A served name: no spaces, no '=' or ':'.
_MODEL_PATH = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*$")
_NAME = re.compile(r"^[A-Za-z0-9_][\w.\-]*$")


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


def builtin_model_class(name: str) -> type[Model]:
    """The class of a built-in model (settings check their option blocks with it; no weights load)."""
    return _import_model(BUILTIN_MODELS[name])


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
