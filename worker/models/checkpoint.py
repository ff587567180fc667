"""What a local checkpoint directory holds, read and checked before any weights load: the Hugging Face files
an encoder or classifier needs, and the sentence-transformers modules around them (pooling, normalize,
length limit).

It must never import torch or transformers, never run code from the directory (no remote code), and never
reach a hub. Every problem is a CheckpointError whose message is one line naming the path and what is wrong.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from worker.errors import SetupError

# sentence-transformers' pooling modes this server runs (its Pooling module's names).
POOLING_MODES = ("mean", "cls", "max", "lasttoken")
# The legacy 1_Pooling/config.json flags and the mode each one stands for.
LEGACY_POOLING_FLAGS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
SENTENCE_CONFIG_FILES = (
    "sentence_bert_config.json",
    "sentence_roberta_config.json",
    "sentence_xlm-roberta_config.json",
)
# The longest safetensors header we read: larger is a corrupt length field, not a real header.
MAX_HEADER_BYTES = 100 * 2**20


class CheckpointError(SetupError):
    """A checkpoint directory that cannot be served; the message names the path and what is wrong."""


@dataclass(frozen=True, slots=True)
class EncoderLayout:
    """An embedding checkpoint as sentence-transformers would run it."""

    model_dir: Path  # the Hugging Face model (the directory itself, or its Transformer module's folder)
    pooling: str  # one of POOLING_MODES
    normalize: bool
    max_seq_length: int | None  # sentence-transformers' limit; None: the tokenizer's, capped at the positions
    lower_case: bool = False


def read_json(path: Path, label: str) -> Any:
    """A JSON file of the checkpoint; CheckpointError if it is missing or not JSON."""
    if not path.is_file():
        raise CheckpointError(f"{label}: {path.name} is missing ({path})")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError, OSError) as exc:
        raise CheckpointError(f"{label}: {path.name} is not valid JSON ({_first_line(exc)})") from None


def checked_directory(directory: str, kind: str) -> Path:
    path = Path(directory).expanduser()
    if not path.exists():
        raise CheckpointError(f"{kind}:{directory}: no such directory")
    if not path.is_dir():
        raise CheckpointError(f"{kind}:{directory}: not a directory")
    return path


def check_hf_model(
    model_dir: Path, label: str, *, classifier: bool, fast_tokenizer: bool = True
) -> dict[str, Any]:
    """The model's config.json after checking it needs no remote code, names a known architecture, and that
    its weights and (``fast_tokenizer``) its fast tokenizer are there and readable."""
    config = read_json(model_dir / "config.json", label)
    if not isinstance(config, dict):
        raise CheckpointError(f"{label}: config.json is not a JSON object")
    if config.get("auto_map") or config.get("trust_remote_code"):
        raise CheckpointError(
            f"{label}: config.json needs remote code (auto_map); batchwork never runs code from a checkpoint"
        )
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not _known_model_type(model_type):
        raise CheckpointError(
            f"{label}: config.json model_type {model_type!r} is not one transformers knows "
            "(a model that needs remote code is not served)"
        )
    if classifier:
        _check_classifier_config(config, label)
    _check_weights(model_dir, label)
    if fast_tokenizer:
        _check_tokenizer(model_dir, label)
    return config


def _check_classifier_config(config: dict[str, Any], label: str) -> None:
    architectures = config.get("architectures") or []
    if not any(str(name).endswith("ForSequenceClassification") for name in architectures):
        raise CheckpointError(
            f"{label}: config.json architectures {architectures} name no *ForSequenceClassification "
            "(a classifier head would be random)"
        )
    id2label = config.get("id2label")
    if not isinstance(id2label, dict) or not id2label:
        raise CheckpointError(f"{label}: config.json has no id2label")


def _check_weights(model_dir: Path, label: str) -> None:
    present = [name for name in WEIGHT_FILES if (model_dir / name).is_file()]
    if not present:
        raise CheckpointError(f"{label}: no weights in {model_dir} (expected {' or '.join(WEIGHT_FILES)})")
    if present[0] == "model.safetensors":
        check_safetensors(model_dir / "model.safetensors", label)
    elif present[0] == "model.safetensors.index.json":
        index = read_json(model_dir / present[0], label)
        shards = sorted(set((index.get("weight_map") or {}).values())) if isinstance(index, dict) else []
        if not shards:
            raise CheckpointError(f"{label}: model.safetensors.index.json has no weight_map")
        for shard in shards:
            check_safetensors(model_dir / shard, label)


def check_safetensors(path: Path, label: str) -> None:
    """The file's header parses and its tensors lie within the file (a truncated copy is refused)."""
    if not path.is_file():
        raise CheckpointError(f"{label}: weights file {path.name} is missing")
    size = path.stat().st_size
    try:
        with path.open("rb") as handle:
            (header_bytes,) = struct.unpack("<Q", handle.read(8))
            if not 0 < header_bytes <= min(MAX_HEADER_BYTES, size - 8):
                raise ValueError("bad header length")
            header = json.loads(handle.read(header_bytes))
        end = max(
            (entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"), default=0
        )
    except (ValueError, KeyError, TypeError, IndexError, struct.error, OSError, UnicodeDecodeError):
        raise CheckpointError(f"{label}: {path.name} is corrupt (unreadable safetensors header)") from None
    if 8 + header_bytes + end > size:
        raise CheckpointError(f"{label}: {path.name} is corrupt (truncated: {size} bytes, tensors need more)")


def _check_tokenizer(model_dir: Path, label: str) -> None:
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise CheckpointError(
            f"{label}: tokenizer.json is missing (a fast tokenizer is needed) in {model_dir}"
        )
    from tokenizers import Tokenizer

    try:
        Tokenizer.from_file(str(path))
    except Exception as exc:  # the Rust parser's errors have no common Python type
        raise CheckpointError(f"{label}: tokenizer.json is corrupt ({_first_line(exc)})") from None
    for extra in ("tokenizer_config.json", "special_tokens_map.json"):  # read by AutoTokenizer at load
        if (model_dir / extra).is_file():
            read_json(model_dir / extra, label)


def embed_layout(directory: Path, label: str) -> EncoderLayout:
    """The sentence-transformers modules when modules.json is there, else a plain encoder (mean pooling,
    normalized)."""
    modules_file = directory / "modules.json"
    if not modules_file.exists():
        return EncoderLayout(directory, "mean", True, None)
    modules = read_json(modules_file, label)
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise CheckpointError(f"{label}: modules.json is not a list of modules")
    transformer: Path | None = None
    pooling, normalize = "mean", False
    seen_pooling = False
    for module in sorted(modules, key=lambda m: int(m.get("idx", 0))):
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        folder = directory / str(module.get("path", ""))
        if kind == "Transformer" and transformer is None:
            transformer = folder
        elif kind == "Pooling" and transformer is not None and not seen_pooling:
            pooling, seen_pooling = pooling_mode(folder, label), True
        elif kind == "Normalize" and transformer is not None:
            normalize = True
        else:
            raise CheckpointError(f"{label}: modules.json: module {module.get('type')!r} is not supported")
    if transformer is None:
        raise CheckpointError(f"{label}: modules.json has no Transformer module")
    if not seen_pooling:
        raise CheckpointError(f"{label}: modules.json has no Pooling module (token vectors are not served)")
    max_seq_length, lower_case = _sentence_config(transformer, label)
    return EncoderLayout(transformer, pooling, normalize, max_seq_length, lower_case)


def pooling_mode(folder: Path, label: str) -> str:
    """The one pooling mode of a Pooling module: sentence-transformers 6's ``pooling_mode`` or the legacy
    ``pooling_mode_*`` flags."""
    config = read_json(folder / "config.json", f"{label}: {folder.name}")
    if not isinstance(config, dict):
        raise CheckpointError(f"{label}: {folder.name}/config.json is not a JSON object")
    mode: Any = config.get("pooling_mode")
    if mode is None:
        mode = [name for flag, name in LEGACY_POOLING_FLAGS.items() if config.get(flag)]
    if isinstance(mode, list) and len(mode) == 1:
        mode = mode[0]
    if mode not in POOLING_MODES:
        raise CheckpointError(
            f"{label}: pooling mode {mode!r} is not supported (supported: {', '.join(POOLING_MODES)})"
        )
    return str(mode)


def _sentence_config(transformer: Path, label: str) -> tuple[int | None, bool]:
    for name in SENTENCE_CONFIG_FILES:
        path = transformer / name
        if path.exists():
            config = read_json(path, label)
            if not isinstance(config, dict):
                raise CheckpointError(f"{label}: {name} is not a JSON object")
            limit = config.get("max_seq_length")
            if limit is not None and not (isinstance(limit, int) and limit > 0):
                raise CheckpointError(f"{label}: {name} max_seq_length {limit!r} is not a positive integer")
            return limit, bool(config.get("do_lower_case", False))
    return None, False


def _known_model_type(model_type: str) -> bool:
    """Whether transformers' AutoConfig knows ``model_type``. Most types have a folder of their own under
    transformers/models, found without importing anything (importing the mapping imports torch, which a
    settings check must not wait for); any other name is looked up in the mapping itself."""
    import importlib.util

    spec = importlib.util.find_spec("transformers")  # the package's folder; nothing is imported
    if spec is not None and spec.origin is not None:
        folder = Path(spec.origin).parent / "models" / model_type.replace("-", "_")
        if (folder / "__init__.py").is_file():
            return True
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return model_type in CONFIG_MAPPING_NAMES


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__
