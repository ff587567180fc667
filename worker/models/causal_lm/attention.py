"""Our paged KV cache plugged into transformers' attention interface, under the name ``batchwork_paged``.

A model loaded with ``attn_implementation="batchwork_paged"`` runs its own layers (embeddings, RoPE, norms,
MLPs, logit soft-capping) and calls ``paged_attention`` in place of its attention, with the keys and values
of this step's new tokens. The function writes them into the PagePool at the slots the step names and
attends over each sequence's cached tokens. The model is called without a transformers cache
(``use_cache=False``): which pages a sequence holds is the SequenceScheduler's alone.

It must never keep state between calls: the layout of a step comes in with every forward, as the
``batchwork`` keyword, which transformers passes through to every attention call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F

from worker.models.causal_lm.cache import PagePool

NAME = "batchwork_paged"


@dataclass(frozen=True, slots=True)
class Context:
    """One decoding row's cached tokens (this step's included): the ``length`` tokens from slot ``first``
    when its pages are consecutive (a slice of the pool, read in place), else those of ``pages``."""

    length: int
    first: int = 0
    pages: torch.Tensor | None = None  # [pages] when not consecutive: they are gathered


@dataclass(frozen=True, slots=True)
class Step:
    """One forward's layout. Prefill: one sequence's whole context from position 0. Decode: one new token
    per sequence, each attending over its own cached tokens, ``contexts`` in row order."""

    pool: PagePool
    slots: (
        torch.Tensor
    )  # [tokens]: where each new token's key and value go in the pool (page * size + offset)
    contexts: tuple[Context, ...] = ()  # empty: a prefill

    @property
    def prefill(self) -> bool:
        return not self.contexts


def decode_step(pool: PagePool, positions: list[int], pages: list[list[int]], device: str) -> Step:
    """The layout of a decode step: each row's new token at ``positions[row]`` over its ``pages``, read in
    place when they are consecutive (as the pool hands them out while it can), else gathered."""
    size = pool.page_tokens
    slots, contexts = [], []
    for at, held in zip(positions, pages, strict=True):
        slots.append(held[at // size] * size + at % size)
        if held[-1] - held[0] == len(held) - 1 and held == list(range(held[0], held[-1] + 1)):
            contexts.append(Context(at + 1, first=held[0] * size))
        else:
            contexts.append(Context(at + 1, pages=torch.tensor(held, device=device)))
    return Step(pool, torch.tensor(slots, device=device), tuple(contexts))


def register() -> None:
    """Make ``batchwork_paged`` an attention implementation transformers knows (once per process)."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, paged_attention)


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    batchwork: Step | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """query [1, heads, tokens, dim], key and value [1, kv_heads, tokens, dim] of the step's new tokens ->
    the attended values [1, tokens, heads, dim], as transformers' attention functions return them."""
    if batchwork is None:
        raise RuntimeError("batchwork_paged attention runs only inside CausalLM's steps")
    if kwargs.get("s_aux") is not None:
        raise ValueError("attention sinks (s_aux) are not supported by batchwork's paged attention")
    step, layer = batchwork, cast(int, module.layer_idx)
    window, softcap = kwargs.get("sliding_window"), kwargs.get("softcap")
    step.pool.write_slots(layer, step.slots, key[0], value[0])  # [kv_heads, tokens, dim]
    if step.prefill:
        out = _prefill(query, key, value, scaling, window, softcap)
    else:
        out = decode_rows(step, layer, query, scaling, window, softcap)
    return out, None


def _prefill(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float | None,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """Causal attention within the one sequence, as transformers' sdpa runs an unpadded prompt."""
    tokens = query.shape[2]
    mask = None
    if window is not None and window < tokens:
        at = torch.arange(tokens, device=query.device)
        mask = (at[None, :] <= at[:, None]) & (at[None, :] > at[:, None] - window)
    out = _attend(query, key, value, mask, scale, softcap, causal=mask is None)
    return out.transpose(1, 2)


def decode_rows(
    step: Step,
    layer: int,
    query: torch.Tensor,
    scale: float | None,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """query [1, heads, rows, dim], a new token per row, over each row's cached keys -> [1, rows, heads, dim].

    Row by row, with no padding and no mask: on the CPU the step is bound by reading the cache, and a
    batched call would first copy every row's pages side by side, padded to the longest (three times
    the memory traffic, measured). The rows' matmuls (the bulk of the work) stay batched in the model.
    """
    parts = []
    for row_query, context in zip(query.split(1, dim=2), step.contexts, strict=True):
        keys, values = step.pool.context(layer, context.first, context.length, context.pages)
        if window is not None and window < context.length:  # the newest ``window`` tokens
            keys, values = keys[:, :, -window:], values[:, :, -window:]
        parts.append(_attend(row_query, keys, values, None, scale, softcap, causal=False))
    # One cat, not a copy per row into a preallocated output: this loop runs rows x layers times a step,
    # and the ops it spares were 3 ms of a 40-55 ms decode step (16 rows, context 20-300), same values.
    return torch.cat(parts, dim=2).transpose(1, 2)


def _attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None,
    softcap: float | None,
    causal: bool,
) -> torch.Tensor:
    groups = query.shape[1] // key.shape[1]
    if softcap is None:
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=groups > 1
        )
    # Soft-capped scores (Gemma 2): SDPA cannot cap, so the eager formula, as transformers' eager runs it.
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(2, 3)) * (
        scale if scale is not None else query.shape[-1] ** -0.5
    )
    scores = torch.tanh(scores / softcap) * softcap
    if causal:
        length = query.shape[2]
        mask = torch.ones(length, length, dtype=torch.bool, device=query.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    weights = scores.softmax(dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(weights, value)
