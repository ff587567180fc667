"""The catalogue of model names a deployment may serve, and BATCHWORK_MODELS entries parsed into specs.

Configuration reads it (settings checks every entry) and the registry resolves specs to classes; it names
models by import path only and never imports one at module level, so settings never depend on a model.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from worker.bounds import MAX_MODEL_NAME_CHARS

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


def check_builtin_options(name: str, block: Mapping[str, Any]) -> None:
    """Check a built-in model's block of BATCHWORK_MODEL_OPTIONS against its Options (ValueError, one line).

    The built-in's module is imported by its path, as the registry imports it (no weights load); a model
    of a user's own checks its block when it is first resolved (registry.model_class).
    """
    module_name, _, class_name = BUILTIN_MODELS[name].partition(":")
    getattr(importlib.import_module(module_name), class_name).options_from(block)


def _parse_entry(entry: str) -> ModelSpec:
    if entry in BUILTIN_MODELS:
        return ModelSpec(entry, BUILTIN_MODELS[entry])
    name, equals, rest = entry.partition("=")
    spec = rest if equals else entry
    kind, colon, directory = spec.partition(":")
    if colon and kind in MODEL_KINDS:
        if equals and not _NAME.fullmatch(name):  # fullmatch: "$" alone lets a final newline by
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
