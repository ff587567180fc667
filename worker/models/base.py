"""The one protocol every model adapter follows, and the errors it raises.

Importing a model module must not import torch: producers and the API validate inputs with
``validate`` and never load weights. torch is imported inside ``load``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from worker.settings import Settings


class InvalidInput(ValueError):
    """An input that cannot run; the message names the item (when there is one) and the field."""

    def __init__(self, detail: str, index: int | None = None) -> None:
        self.detail = detail
        self.index = index
        super().__init__(detail if index is None else f"item {index}: {detail}")


@dataclass(frozen=True, slots=True)
class Prepared:
    """An input made ready for batching: what ``forward`` takes, and its cost in tokens."""

    payload: Any
    length: int = 1


class Model:
    """A model served by batchwork.

    The worker calls ``load`` once, ``prepare`` once per incoming message (all its items at once,
    so tokenizers can work in bulk), and ``forward`` once per batch. ``forward`` must return exactly
    one JSON-serializable output (or numpy array) per payload, in order.
    """

    name: ClassVar[str]
    max_batch_size: ClassVar[int] = 64
    max_wait_ms: ClassVar[float] = 50.0

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    @classmethod
    def validate(cls, index: int, item: object, max_chars: int) -> None:
        """Raise InvalidInput if ``item`` cannot be run; cheap, no weights needed."""
        text_of(index, item, max_chars)

    @staticmethod
    def item_id(item: object) -> str | None:
        """The user's own id of an item (``{"id": ...}``), carried to the results."""
        if isinstance(item, dict):
            ident = item.get("id")
            return None if ident is None else str(ident)
        return None

    def load(self, device: str) -> None:
        """Load weights onto ``device`` ("cpu", "cuda", ...)."""

    def prepare(self, items: Sequence[object]) -> list[Prepared]:
        return [Prepared(item) for item in items]

    def forward(self, payloads: Sequence[Any]) -> Sequence[Any]:
        raise NotImplementedError


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
