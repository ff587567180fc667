"""Any causal LM transformers loads, run a step at a time over our paged KV cache.

It must never reach a model hub or run a checkpoint's own code (``local_files_only``, no
``trust_remote_code``), and it keeps no per-sequence state: the pages and positions of each sequence come
in with every call. Each forward names its layout to ``worker.models.causal_lm.attention``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from worker.models.causal_lm import attention
from worker.models.causal_lm.cache import PagePool

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True, slots=True)
class Shape:
    """What the step loop needs of a checkpoint's config."""

    layers: int
    kv_heads: int
    head_dim: int
    context_tokens: int
    eos_token_ids: frozenset[int]


def load_model(checkpoint: Path, precision: str, device: str) -> Any:
    """The checkpoint as an eval-mode AutoModelForCausalLM whose attention is ours; one line if it is not."""
    import transformers
    from transformers import AutoModelForCausalLM

    attention.register()
    verbosity, bars = transformers.logging.get_verbosity(), transformers.logging.is_progress_bar_enabled()
    transformers.logging.set_verbosity_error()  # no progress bars or notices in a worker's log
    transformers.logging.disable_progress_bar()
    try:
        model: Any = AutoModelForCausalLM.from_pretrained(
            str(checkpoint),
            local_files_only=True,
            trust_remote_code=False,
            dtype=DTYPES[precision],
            attn_implementation=attention.NAME,
        )
    except Exception as exc:  # transformers raises many kinds; the operator needs the path and the reason
        reason = " ".join(str(exc).split())[:300]
        raise RuntimeError(
            f"{checkpoint}: not a causal LM transformers can load offline ({reason})"
        ) from None
    finally:
        transformers.logging.set_verbosity(verbosity)
        if bars:
            transformers.logging.enable_progress_bar()
    return model.to(device).eval()


def read_shape(model: Any) -> Shape:
    config = model.config.get_text_config()
    heads = int(config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or int(config.hidden_size) // heads
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = config.eos_token_id
    return Shape(
        layers=int(config.num_hidden_layers),
        kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
        head_dim=int(head_dim),
        context_tokens=int(config.max_position_embeddings),
        eos_token_ids=frozenset([] if eos is None else [eos] if isinstance(eos, int) else eos),
    )


class Network:
    """Forwards of the loaded model: one whole context (prefill), or one new token per sequence (decode)."""

    def __init__(self, model: Any, pool: PagePool, device: str) -> None:
        self.model = model
        self.pool = pool
        self.device = device

    @torch.inference_mode()
    def prefill(self, context: list[int], pages: list[int]) -> torch.Tensor:
        """Run one sequence's whole context from position 0, cache it, and give its last logits [1, vocab]."""
        positions = torch.arange(len(context), device=self.device)
        table = torch.tensor(pages, device=self.device)
        slots = (
            table[positions // self.pool.page_tokens] * self.pool.page_tokens
            + positions % self.pool.page_tokens
        )
        step = attention.Step(self.pool, slots)
        ids = torch.tensor(context, device=self.device)
        return self._forward(ids, positions, step, keep=1)

    @torch.inference_mode()
    def decode(self, tokens: list[int], positions: list[int], pages: list[list[int]]) -> torch.Tensor:
        """Feed each sequence its latest token at its own position, over its own cache: logits [b, vocab].

        Each row's attention reads only its own cached tokens: in place when its pages are consecutive
        (as the pool hands them out while it can), else gathered.
        """
        step = attention.decode_step(self.pool, positions, pages, self.device)
        ids = torch.tensor(tokens, device=self.device)
        return self._forward(ids, torch.tensor(positions, device=self.device), step, keep=0)

    def _forward(
        self, ids: torch.Tensor, positions: torch.Tensor, step: attention.Step, keep: int
    ) -> torch.Tensor:
        out = self.model(
            input_ids=ids[None],
            position_ids=positions[None],
            use_cache=False,
            logits_to_keep=keep,
            batchwork=step,
        )
        return out.logits[0]
