"""GPT-2 in plain torch: the weights of a local checkpoint, a one-sequence prefill and a one-token decode
step over the generate kind's paged KV cache; ``gpt2``'s forwards in place of transformers' (measured
faster on the same requests: bench/README.md, "gpt2's network vs the generic path").

It must never use transformers' model classes (they are the tests' reference) nor reach a model hub, and
it keeps no per-sequence state: the cache pages and positions of each sequence come in with every call.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from worker.models.causal_lm import attention
from worker.models.causal_lm.cache import PagePool
from worker.models.causal_lm.network import Shape as Layout

# Both names are the tanh approximation GPT-2 was trained with.
TANH_GELU = ("gelu_new", "gelu_pytorch_tanh")
GELU_SCALE = math.sqrt(2.0 / math.pi)

# The attention step of one layer: (layer, q, k, v), each [batch, heads, steps, dim] -> the same shape.
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
Take = Callable[[str], torch.Tensor]


@dataclass(frozen=True, slots=True)
class Shape:
    """The parts of a GPT-2 config.json this network honours."""

    layers: int
    heads: int
    width: int
    inner: int
    context_tokens: int
    vocab: int
    eps: float
    scale_by_layer: bool  # scale_attn_by_inverse_layer_idx
    eos_token_ids: frozenset[int]

    @property
    def head_dim(self) -> int:
        return self.width // self.heads


@dataclass(frozen=True, slots=True)
class Block:
    ln_1: tuple[torch.Tensor, torch.Tensor]
    attn: tuple[torch.Tensor, torch.Tensor]  # Conv1D: weight [in, out], so x @ weight + bias
    attn_proj: tuple[torch.Tensor, torch.Tensor]
    ln_2: tuple[torch.Tensor, torch.Tensor]
    fc: tuple[torch.Tensor, torch.Tensor]
    fc_proj: tuple[torch.Tensor, torch.Tensor]


class NotGPT2(ValueError):
    """A checkpoint this network does not run: another architecture, or a GPT-2 option it does not honour."""


def read_shape(checkpoint: Path) -> Shape:
    config = json.loads((checkpoint / "config.json").read_text())
    if config.get("model_type") != "gpt2":
        raise NotGPT2(f"{checkpoint}/config.json: model_type {config.get('model_type')!r} is not gpt2")
    activation = config.get("activation_function", "gelu_new")
    if activation not in TANH_GELU:
        raise NotGPT2(f"{checkpoint}/config.json: activation {activation!r} is not GPT-2's gelu_new")
    if (
        config.get("add_cross_attention")
        or not config.get("scale_attn_weights", True)
        or config.get("reorder_and_upcast_attn")
    ):
        raise NotGPT2(f"{checkpoint}/config.json: cross-attention / unscaled or upcast attention")
    eos = _generation_eos(checkpoint)
    if eos is None:
        eos = config.get("eos_token_id")
    width = int(config["n_embd"])
    return Shape(
        layers=int(config["n_layer"]),
        heads=int(config["n_head"]),
        width=width,
        inner=int(config.get("n_inner") or 4 * width),
        context_tokens=int(config["n_positions"]),
        vocab=int(config["vocab_size"]),
        eps=float(config.get("layer_norm_epsilon", 1e-5)),
        scale_by_layer=bool(config.get("scale_attn_by_inverse_layer_idx", False)),
        eos_token_ids=frozenset([] if eos is None else [eos] if isinstance(eos, int) else eos),
    )


def _generation_eos(checkpoint: Path) -> int | list[int] | None:
    """The end-of-sequence id(s) generation_config.json lists, as the generic path (and generate) reads
    them; None where it has none."""
    try:
        eos = json.loads((checkpoint / "generation_config.json").read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return None
    return eos if isinstance(eos, int | list) else None


def read_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The tensors of model.safetensors (or pytorch_model.bin), named without the ``transformer.`` prefix."""
    safetensors = checkpoint / "model.safetensors"
    if safetensors.exists():
        from safetensors.torch import load_file

        tensors = load_file(str(safetensors))
    elif (checkpoint / "pytorch_model.bin").exists():
        # weights_only: a checkpoint is data, never code to run.
        tensors = torch.load(checkpoint / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise FileNotFoundError(f"{checkpoint} has neither model.safetensors nor pytorch_model.bin")
    # HF's GPT2LMHeadModel saves "transformer.h.0...", the original OpenAI conversion "h.0...".
    return {name.removeprefix("transformer."): tensor for name, tensor in tensors.items()}


class GPT2Network:
    """The forward pass; keys and values go to and come from ``pool`` at the pages each call names."""

    def __init__(self, shape: Shape, weights: dict[str, torch.Tensor], pool: PagePool, device: str) -> None:
        self.shape = shape
        self.pool = pool
        self.device = device
        take = _taker(weights, device, pool.keys.dtype)
        self.wte = take("wte.weight")
        self.wpe = take("wpe.weight")
        # Tied unless the checkpoint carries its own head.
        self.lm_head = take("lm_head.weight") if "lm_head.weight" in weights else self.wte
        self.ln_f = (take("ln_f.weight"), take("ln_f.bias"))
        self.blocks = [_block(take, f"h.{i}.") for i in range(shape.layers)]
        self.scales = [
            shape.head_dim**-0.5 / (i + 1 if shape.scale_by_layer else 1) for i in range(shape.layers)
        ]

    @property
    def layout(self) -> Layout:
        """What the generate kind's step loop needs of this network (the cache's shape, context, EOS ids)."""
        shape = self.shape
        return Layout(shape.layers, shape.heads, shape.head_dim, shape.context_tokens, shape.eos_token_ids)

    @torch.inference_mode()
    def prefill(self, context: list[int], pages: list[int]) -> torch.Tensor:
        """Run one sequence's whole context from position 0, cache it, and give its last logits [1, vocab]."""
        positions = torch.arange(len(context), device=self.device)
        table = torch.tensor(pages, device=self.device)
        size = self.pool.page_tokens
        slots = table[positions // size] * size + positions % size

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            self.pool.write_slots(layer, slots, k[0], v[0])
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scales[layer])

        ids = torch.tensor(context, device=self.device)[None]
        return self._logits(self._layers(ids, positions[None], attend)[:, -1])

    @torch.inference_mode()
    def decode(self, tokens: list[int], positions: list[int], pages: list[list[int]]) -> torch.Tensor:
        """Feed each sequence its latest token at its own position, over its own cache: logits [b, vocab].

        Each row's attention reads only its own cached tokens, as the generic network's decode does (the
        same step layout and the same row-by-row attention: in place where its pages are consecutive).
        """
        step = attention.decode_step(self.pool, positions, pages, self.device)

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            self.pool.write_slots(layer, step.slots, k[:, :, 0].transpose(0, 1), v[:, :, 0].transpose(0, 1))
            # [rows, heads, 1, dim] here; decode_rows takes transformers' layout [1, heads, rows, dim].
            out = attention.decode_rows(step, layer, q.transpose(0, 2), self.scales[layer], None, None)
            return out[0].unsqueeze(2)

        at = torch.tensor(positions, device=self.device)
        ids = torch.tensor(tokens, device=self.device)[:, None]
        return self._logits(self._layers(ids, at[:, None], attend)[:, 0])

    def _layers(self, ids: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        hidden = self.wte[ids] + self.wpe[positions]
        for layer, block in enumerate(self.blocks):
            hidden = self._block(layer, block, hidden, attend)
        return hidden

    def _block(self, layer: int, block: Block, hidden: torch.Tensor, attend: Attend) -> torch.Tensor:
        batch, steps, width = hidden.shape
        heads = self.shape.heads
        x = F.layer_norm(hidden, (width,), *block.ln_1, eps=self.shape.eps)
        q, k, v = (
            part.view(batch, steps, heads, -1).transpose(1, 2)
            for part in _conv1d(x, block.attn).split(width, dim=2)
        )
        attended = attend(layer, q, k, v).transpose(1, 2).reshape(batch, steps, width)
        hidden = hidden + _conv1d(attended, block.attn_proj)
        x = F.layer_norm(hidden, (width,), *block.ln_2, eps=self.shape.eps)
        return hidden + _conv1d(_gelu_new(_conv1d(x, block.fc)), block.fc_proj)

    def _logits(self, last: torch.Tensor) -> torch.Tensor:
        return F.linear(F.layer_norm(last, (self.shape.width,), *self.ln_f, eps=self.shape.eps), self.lm_head)


def _conv1d(x: torch.Tensor, weight_bias: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    # addmm over the flattened rows, exactly as transformers' Conv1D does, so rounding matches the reference.
    weight, bias = weight_bias
    return torch.addmm(bias, x.reshape(-1, x.shape[-1]), weight).view(*x.shape[:-1], weight.shape[1])


def _gelu_new(x: torch.Tensor) -> torch.Tensor:
    # Written out as in transformers' NewGELUActivation: F.gelu(approximate="tanh") rounds differently.
    return 0.5 * x * (1.0 + torch.tanh(GELU_SCALE * (x + 0.044715 * torch.pow(x, 3.0))))


def _taker(weights: dict[str, torch.Tensor], device: str, dtype: torch.dtype) -> Take:
    def take(name: str) -> torch.Tensor:
        if name not in weights:
            raise KeyError(f"GPT-2 checkpoint lacks the tensor {name!r}")
        return weights[name].to(device=device, dtype=dtype)

    return take


def _block(take: Take, prefix: str) -> Block:
    def pair(name: str) -> tuple[torch.Tensor, torch.Tensor]:
        return take(f"{prefix}{name}.weight"), take(f"{prefix}{name}.bias")

    return Block(
        ln_1=pair("ln_1"),
        attn=pair("attn.c_attn"),
        attn_proj=pair("attn.c_proj"),
        ln_2=pair("ln_2"),
        fc=pair("mlp.c_fc"),
        fc_proj=pair("mlp.c_proj"),
    )
