"""BATCHWORK_MODELS entries: built-in names, import paths and checkpoints of a model kind (NAME=KIND:/dir)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from worker.models.registry import MODEL_KINDS, ModelSpec, parse_model_entry
from worker.settings import Settings


@pytest.mark.parametrize(
    ("entry", "spec"),
    [
        ("minilm", ModelSpec("minilm", "worker.models.minilm:MiniLM")),
        ("pkg.mod:Cls", ModelSpec("pkg.mod:Cls", "pkg.mod:Cls")),
        ("e5=embed:/models/e5", ModelSpec("e5", MODEL_KINDS["embed"], "embed", "/models/e5")),
        ("mod-1.x=classify:rel/dir", ModelSpec("mod-1.x", MODEL_KINDS["classify"], "classify", "rel/dir")),
        (
            "generate:/m/llama",
            ModelSpec("generate:/m/llama", MODEL_KINDS["generate"], "generate", "/m/llama"),
        ),
    ],
)
def test_entries_parse_to_their_spec(entry: str, spec: ModelSpec) -> None:
    assert parse_model_entry(entry) == spec


@pytest.mark.parametrize(
    "entry",
    [
        "",
        "garbage model",
        "x=",
        "=embed:/d",
        "a b=embed:/d",
        "x\n=embed:/d",  # "$" alone would let the final newline by
        "e5=embed:",
        "e5=tpu:/d",
        "x=pkg.mod:Cls",
        "a" * 201,
    ],
)
def test_bad_entries_are_refused_in_one_line(entry: str) -> None:
    with pytest.raises(ValueError) as caught:
        parse_model_entry(entry)
    assert "\n" not in str(caught.value)


def test_settings_serve_checkpoints_under_their_names() -> None:
    settings = Settings(models=["noop", "e5=embed:/models/e5"])
    assert list(settings.served) == ["noop", "e5"]
    assert settings.served["e5"].checkpoint == "/models/e5"
    with pytest.raises(ValidationError, match="named twice"):
        Settings(models=["e5=embed:/a", "e5=classify:/b"])


def test_the_embedded_run_serves_its_own_checkpoint_only_in_its_process() -> None:
    settings = Settings(models=["noop"])
    settings.serve_checkpoint("embed:/tmp/e5")
    settings.serve_checkpoint("minilm")  # a name is never added: the allow-list stays the deployment's
    assert list(settings.served) == ["noop", "embed:/tmp/e5"]
