"""The one protocol every model adapter follows, and the errors it raises.

Importing a model module must not import torch: producers and the API validate inputs with
``validate`` and never load weights. torch is imported inside ``load``.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from worker.batching.policy import LanePolicy
from worker.errors import InvalidInput

if TYPE_CHECKING:
    from worker.settings import Settings


Precision = Literal["fp32", "bf16", "fp16", "int8"]


class ModelOptions(BaseModel):
    """One model's options (its block of BATCHWORK_MODEL_OPTIONS); every model has ``precision``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # fp32 is the reference; bf16/fp16 cast the weights (fp16 on CUDA only), int8 is torch's dynamic
    # quantization of Linear layers (CPU only).
    precision: Precision = "fp32"


@dataclass(frozen=True, slots=True)
class Prepared:
    """An input made ready for batching: what ``forward`` takes, and its cost in tokens."""

    payload: Any
    length: int = 1


class Model:
    """A model served by batchwork.

    The worker calls ``load`` once, ``validate`` on each item it receives, ``prepare`` once per incoming
    message (all its checked items at once, so tokenizers can work in bulk), and ``forward`` once per batch.
    ``forward`` must return exactly one JSON-serializable output (or numpy array) per payload, in order.
    """

    name: ClassVar[str]
    # What the model does, for surfaces that need a kind (the OpenAI endpoints): "embed" (a vector per
    # item), "classify" (label and scores), "generate" (text); None for anything else.
    kind: ClassVar[str | None] = None
    # The local checkpoint directory of a model kind served as "NAME=KIND:/dir" (set by the registry).
    checkpoint: ClassVar[str | None] = None
    # The shape of this model's BATCHWORK_MODEL_OPTIONS block; a model with options of its own subclasses it.
    Options: ClassVar[type[ModelOptions]] = ModelOptions
    max_batch_size: ClassVar[int] = 64
    max_wait_ms: ClassVar[float] = 50.0
    # For models whose items have a length in tokens: the padded-token cap of a batch and the length
    # buckets (upper bounds) that keep items of similar length together.
    max_batch_tokens: ClassVar[int | None] = None
    bucket_edges: ClassVar[tuple[int, ...]] = ()

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    @classmethod
    def default_policy(cls) -> LanePolicy:
        """This model's own N, T, token budget and buckets, as its normal lane has them before any setting."""
        return LanePolicy(
            cls.max_batch_size,
            cls.max_wait_ms / 1000,
            max_batch_tokens=cls.max_batch_tokens,
            bucket_edges=cls.bucket_edges,
        )

    @classmethod
    def options_from(cls, block: Mapping[str, Any]) -> ModelOptions:
        """A block of BATCHWORK_MODEL_OPTIONS checked as this model's Options; ValueError (one line) if
        it does not fit."""
        try:
            return cls.Options.model_validate(block)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(part) for part in first["loc"]) or "options"
            problem = "unknown option" if first["type"] == "extra_forbidden" else first["msg"]
            raise ValueError(f"{getattr(cls, 'name', cls.__qualname__)}: {where}: {problem}") from None

    def options(self) -> ModelOptions:
        """This model's block of BATCHWORK_MODEL_OPTIONS (defaults where it has none)."""
        return self.options_from(self.settings.model_options.get(self.name, {}))

    @classmethod
    def validate(cls, index: int, item: object, settings: Settings) -> Any:
        """Raise InvalidInput if ``item`` cannot be run; else return what ``prepare`` takes for it.

        Cheap, no weights needed: producers call it on every item before anything is enqueued, the worker
        once more on every item it receives (a raw Celery call can skip the producer), and nothing else
        checks the item again. The default takes a string or an object with a string field ``text``.
        """
        return text_of(index, item, settings.max_input_chars)

    @classmethod
    def check_checkpoint(cls) -> object:
        """For a model kind over a checkpoint directory: read and check the directory without loading
        weights, raising SetupError (one line naming the path and what is wrong) if it cannot be served.
        Workers call it for every served kind entry at start, `batchwork run` before any work."""
        return None

    def load(self, device: str) -> None:
        """Load weights onto ``device`` ("cpu", "cuda", ...)."""

    def prepare(self, checked: Sequence[Any]) -> list[Prepared]:
        """Make a message's checked items (what ``validate`` returned) ready for batching, all at once."""
        return [Prepared(item) for item in checked]

    def forward(self, payloads: Sequence[Any]) -> Sequence[Any]:
        raise NotImplementedError

    def release_memory(self) -> None:
        """Free what a batch that ran out of memory left allocated, before smaller batches run."""
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available():
            torch.cuda.empty_cache()


def text_of(index: int, item: object, max_chars: int) -> str:
    """The text of a text-model input: a string, or an object with a string field ``text``."""
    if isinstance(item, dict):
        if "text" not in item:
            raise InvalidInput("missing field 'text'", index)
        item = item["text"]
    elif not isinstance(item, str):
        raise InvalidInput("expected a string or an object with field 'text'", index)
    if not isinstance(item, str):
        raise InvalidInput("field 'text' must be a string", index)
    if not item.strip():
        raise InvalidInput("field 'text' is empty", index)
    if len(item) > max_chars:
        raise InvalidInput(f"field 'text' has {len(item)} characters, over the limit of {max_chars}", index)
    return item


@dataclass(frozen=True, slots=True)
class FinishedSequence:
    """What a StepModel's ``step`` returns for a sequence that left its running batch: the item's output (what
    is stored), or the error that ended it, under the key it was admitted with."""

    key: Any
    output: Any = None
    error: str | None = None
    tokens: int | None = None  # tokens generated, when it generated any


class StepModel(Model):
    """A model driven one decode step at a time, for continuous batching.

    The engine admits prepared sequences while ``can_admit`` says there is room, then calls ``step``
    again and again; each step advances every running sequence by one token and returns those that
    finished (EOS or their token limit). Sequences admitted since the last step are prefilled in it.
    A model whose KV cache runs short preempts its newest sequences itself and resumes them later
    (recomputing their cache); it never fails a sequence for lack of room.
    """

    max_running: ClassVar[int] = 32

    def can_admit(self, length: int) -> bool:
        """Is there room (a slot and KV budget) for a new sequence of ``length`` prompt tokens?"""
        raise NotImplementedError

    def admit(self, key: Any, payload: Any) -> None:
        """Add a prepared sequence; ``key`` comes back in its FinishedSequence."""
        raise NotImplementedError

    def step(self) -> list[FinishedSequence]:
        raise NotImplementedError

    def running(self) -> int:
        """Sequences admitted and not yet finished (including preempted ones waiting to resume)."""
        raise NotImplementedError

    def progress(self) -> list[tuple[Any, int]]:
        """(key, tokens generated so far) of each running sequence, for ``batchwork status``."""
        return []

    def abort(self, error: str) -> list[FinishedSequence]:
        """End every admitted sequence with ``error`` and free what they hold: ``step`` raised, and the engine
        must not step them again (each step would fail the same way) nor leave their items unfinished."""
        raise NotImplementedError

    def forward(self, payloads: Sequence[Any]) -> Sequence[Any]:
        raise TypeError(f"{type(self).__name__} runs step by step; the engine drives it with admit/step")
