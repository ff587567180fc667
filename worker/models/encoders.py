"""Model kinds over a local checkpoint: ``embed`` (sentence embeddings, as sentence-transformers' ``encode``)
and ``classify`` (label and scores, as transformers' text-classification pipeline), on torch or ONNX Runtime.

Importing this module must not import torch or transformers: producers validate inputs with it and never
load weights. ``load`` reads the directory (worker/models/checkpoint.py), the tokenizer and the weights;
``prepare`` tokenizes a whole message at once; ``forward`` pads a batch and runs the backend
(worker/models/encoder_backends.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np
from pydantic import Field

from worker.errors import InvalidInput
from worker.models.base import Model, ModelOptions, Prepared, text_of
from worker.models.checkpoint import EncoderLayout, check_hf_model, checked_directory, embed_layout

if TYPE_CHECKING:
    from tokenizers import Encoding, Tokenizer

    from worker.models.encoder_backends import Runner
    from worker.settings import Settings

Backend = Literal["torch", "onnx", "auto"]


class EncoderOptions(ModelOptions):
    """Options of a checkpoint served as ``embed`` or ``classify`` (BATCHWORK_MODEL_OPTIONS["NAME"])."""

    # auto: the backend `batchwork tune --backends` chose for this model and device kind, else onnx on a CPU
    # and torch on CUDA.
    backend: Backend = "auto"
    # Tokens kept per input (special tokens included); default: where sentence-transformers / the pipeline
    # truncate.
    max_length: int | None = Field(default=None, ge=1)


class EmbedOptions(EncoderOptions):
    # None: as the checkpoint says (its Normalize module; a plain encoder directory is normalized).
    normalize: bool | None = None
    # Prepended to every text, e.g. "query: " for e5 models.
    prefix: str = ""


class Encoder(Model):
    """What both kinds share: the checkpoint, tokenization, padding and the backend that runs a batch."""

    Options: ClassVar[type[ModelOptions]] = EncoderOptions
    # As MiniLM (`batchwork tune minilm`, see minilm.py): N 32 on a CPU, length buckets 8 tokens
    # wide to 256, then coarser up to the longest limits checkpoints have; `batchwork tune` refines them.
    max_batch_size = 32
    max_wait_ms = 50.0
    bucket_edges = (*range(8, 257, 8), 320, 384, 448, 512, 1024, 2048, 4096, 8192)
    max_batch_tokens = 4096

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.opts: Any = self.options()
        self.precision: str = self.opts.precision
        self.backend = "torch"
        self.max_length = 0
        self._tokenizer: Tokenizer | None = None
        self._pad_id = 0
        self._runner: Runner | None = None

    @classmethod
    def label(cls) -> str:
        return f"{cls.kind}:{cls.checkpoint}"

    @classmethod
    def check_checkpoint(cls) -> Any:
        """Read and check the directory without loading weights; CheckpointError (one line) if it cannot
        be served. Workers call it for every served kind entry at start, `batchwork run` before any work."""
        raise NotImplementedError

    def load(self, device: str) -> None:
        from worker.models.encoder_backends import load_backend, load_tokenizer

        model_dir, config, pooling = self._read()
        limits = (config, self.opts.max_length, self._layout_limit(), self._lower_case())
        setup, self._runner, self.backend, self.precision = load_backend(
            self, model_dir, device, pooling, lambda source: load_tokenizer(source, *limits)
        )
        self._tokenizer, self._pad_id, self.max_length = setup.tokenizer, setup.pad_id, setup.max_length

    def _read(self) -> tuple[Path, dict[str, Any], str | None]:
        raise NotImplementedError

    def _layout_limit(self) -> int | None:
        return None

    def _lower_case(self) -> bool:
        return False

    def _encode(self, inputs: list[Any]) -> list[Encoding]:
        if self._tokenizer is None:
            raise RuntimeError(f"{type(self).__name__}.prepare called before load()")
        return self._tokenizer.encode_batch(inputs)

    def _run(self, payloads: Sequence[tuple[list[int], list[int] | None]]) -> np.ndarray:
        if self._runner is None:
            raise RuntimeError(f"{type(self).__name__}.forward called before load()")
        return self._runner.run(*pad(payloads, self._pad_id))


class Embedder(Encoder):
    """Sentence embeddings of a local checkpoint (sentence-transformers layout or a plain encoder)."""

    kind = "embed"
    Options = EmbedOptions

    @classmethod
    def check_checkpoint(cls) -> EncoderLayout:
        label = cls.label()
        layout = embed_layout(checked_directory(cls.checkpoint or "", "embed"), label)
        check_hf_model(layout.model_dir, label, classifier=False)
        return layout

    def _read(self) -> tuple[Path, dict[str, Any], str | None]:
        self.layout = self.check_checkpoint()
        self.normalize = self.layout.normalize if self.opts.normalize is None else self.opts.normalize
        return self.layout.model_dir, _config(self.layout.model_dir), self.layout.pooling

    def _layout_limit(self) -> int | None:
        return self.layout.max_seq_length

    def _lower_case(self) -> bool:
        return self.layout.lower_case

    def prepare(self, checked: Sequence[str]) -> list[Prepared]:
        """The token ids of each text (one segment: no segment ids to carry)."""
        prefix = self.opts.prefix
        encodings = self._encode([prefix + text for text in checked] if prefix else list(checked))
        return [Prepared(payload=encoding.ids, length=len(encoding.ids)) for encoding in encodings]

    def forward(self, payloads: Sequence[list[int]]) -> list[np.ndarray]:
        rows = self._run([(ids, None) for ids in payloads])
        if self.normalize:
            norms = np.linalg.norm(rows, axis=1, keepdims=True)
            rows = rows / np.maximum(norms, 1e-12)  # torch.nn.functional.normalize's eps
        return list(rows.astype(np.float32, copy=False))


class Classifier(Encoder):
    """Labels and scores of a local sequence-classification checkpoint (softmax, or sigmoid per label)."""

    kind = "classify"

    @classmethod
    def check_checkpoint(cls) -> dict[str, Any]:
        directory = checked_directory(cls.checkpoint or "", "classify")
        return check_hf_model(directory, cls.label(), classifier=True)

    @classmethod
    def validate(cls, index: int, item: object, settings: Settings) -> Any:
        """A string, or an object with a string ``text`` and optionally a string ``text_pair``."""
        if not isinstance(item, dict) or "text_pair" not in item:
            return text_of(index, item, settings.max_input_chars)
        text = text_of(index, {"text": item.get("text")} if "text" in item else {}, settings.max_input_chars)
        pair = item["text_pair"]
        if not isinstance(pair, str):
            raise InvalidInput("field 'text_pair' must be a string", index)
        if len(text) + len(pair) > settings.max_input_chars:
            raise InvalidInput(
                f"fields 'text' and 'text_pair' have {len(text) + len(pair)} characters, over the limit of "
                f"{settings.max_input_chars}",
                index,
            )
        return (text, pair)

    def _read(self) -> tuple[Path, dict[str, Any], str | None]:
        config = self.check_checkpoint()
        directory = Path(self.checkpoint or "")
        labels = config["id2label"]
        self.labels = [str(labels.get(str(i), labels.get(i, f"LABEL_{i}"))) for i in range(len(labels))]
        self.score_function = _score_function(config)
        return directory, config, None

    def prepare(self, checked: Sequence[str | tuple[str, str]]) -> list[Prepared]:
        encodings = self._encode(list(checked))
        return [Prepared(payload=_payload(encoding), length=len(encoding.ids)) for encoding in encodings]

    def forward(self, payloads: Sequence[tuple[list[int], list[int] | None]]) -> list[dict[str, Any]]:
        scores = self.score_function(self._run(payloads).astype(np.float32))
        outputs = []
        for row in scores:
            best = int(np.argmax(row))
            outputs.append(
                {
                    "label": self.labels[best],
                    "score": float(row[best]),
                    "scores": {label: float(p) for label, p in zip(self.labels, row, strict=True)},
                }
            )
        return outputs


def _score_function(config: dict[str, Any]) -> Any:
    """The pipeline's choice: sigmoid for multi-label (or one label), none for regression, else softmax."""
    problem = config.get("problem_type")
    if problem == "regression":
        return lambda logits: logits
    if problem == "multi_label_classification" or len(config["id2label"]) == 1:
        return lambda logits: 1.0 / (1.0 + np.exp(-logits))
    return _softmax


def _softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return shifted / shifted.sum(axis=-1, keepdims=True)


def _config(model_dir: Path) -> dict[str, Any]:
    import json

    return dict(json.loads((model_dir / "config.json").read_text(encoding="utf-8")))


def _payload(encoding: Encoding) -> tuple[list[int], list[int] | None]:
    """Token ids, and the segment ids only where a text pair made some non-zero."""
    types = encoding.type_ids
    return encoding.ids, types if any(types) else None


def pad(
    payloads: Sequence[tuple[list[int], list[int] | None]], pad_id: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Right-padded token ids, the attention mask (1 at real tokens) and segment ids (None if all zero), to
    the longest payload of this batch."""
    longest = max(len(ids) for ids, _ in payloads)
    input_ids = np.full((len(payloads), longest), pad_id, dtype=np.int64)
    mask = np.zeros((len(payloads), longest), dtype=np.int64)
    with_types = any(types is not None for _, types in payloads)
    type_ids = np.zeros((len(payloads), longest), dtype=np.int64) if with_types else None
    for row, (ids, types) in enumerate(payloads):
        input_ids[row, : len(ids)] = ids
        mask[row, : len(ids)] = 1
        if type_ids is not None and types is not None:
            type_ids[row, : len(types)] = types
    return input_ids, mask, type_ids
