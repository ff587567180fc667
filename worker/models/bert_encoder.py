"""A BERT encoder in plain torch (embeddings and self-attention layers, no pooler) from a local checkpoint.

It must never import transformers (its BertModel is the tests' reference, and importing it cost a worker
2-4 s of CPU at every start) nor reach a model hub. Only ``MiniLM.load`` imports this module, so torch
may be imported at the top.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

# Checkpoint tensors the encoder leaves unused: the pooler (sentence embeddings mean-pool instead) and
# the position_ids buffer older transformers versions saved. Anything else unknown fails the load.
UNUSED_KEYS = frozenset({"pooler.dense.weight", "pooler.dense.bias", "embeddings.position_ids"})


@dataclass(frozen=True, slots=True)
class BertShape:
    """The parts of a BERT config.json this encoder honours."""

    vocab: int
    width: int
    layers: int
    heads: int
    inner: int
    positions: int
    token_types: int
    eps: float


def read_shape(checkpoint: Path) -> BertShape:
    config = json.loads((checkpoint / "config.json").read_text())
    activation = config.get("hidden_act", "gelu")
    if activation != "gelu":
        raise ValueError(f"{checkpoint}/config.json: hidden_act {activation!r} is not the exact (erf) 'gelu'")
    position_type = config.get("position_embedding_type", "absolute")
    if position_type != "absolute":
        raise ValueError(
            f"{checkpoint}/config.json: position_embedding_type {position_type!r} is not 'absolute'"
        )
    return BertShape(
        vocab=int(config["vocab_size"]),
        width=int(config["hidden_size"]),
        layers=int(config["num_hidden_layers"]),
        heads=int(config["num_attention_heads"]),
        inner=int(config["intermediate_size"]),
        positions=int(config["max_position_embeddings"]),
        token_types=int(config.get("type_vocab_size", 2)),
        eps=float(config.get("layer_norm_eps", 1e-12)),
    )


def load_encoder(checkpoint: Path) -> BertEncoder:
    """The encoder of ``checkpoint`` (config.json, model.safetensors) on the CPU, in float32."""
    from safetensors.torch import load_file

    shape = read_shape(checkpoint)
    tensors = load_file(str(checkpoint / "model.safetensors"))
    # BertModel saves "embeddings...", the task heads (BertForMaskedLM, ...) "bert.embeddings...".
    weights = {
        name.removeprefix("bert."): tensor
        for name, tensor in tensors.items()
        if name.removeprefix("bert.") not in UNUSED_KEYS
    }
    # Built on the CPU, random initialization and all (0.15 s): building on the meta device instead
    # imported torch._dynamo, 1.2-1.8 s. assign=True hands the parameters the checkpoint's own tensors
    # (no copy), and strict=True proves every parameter came from the checkpoint and every weight landed.
    encoder = BertEncoder(shape)
    encoder.load_state_dict(weights, strict=True, assign=True)
    return encoder.float().eval()


class BertEncoder(nn.Module):
    """Token ids in, the last layer's hidden states out; attribute names are the checkpoint's keys."""

    def __init__(self, shape: BertShape) -> None:
        super().__init__()
        self.embeddings = Embeddings(shape)
        self.encoder = LayerStack(shape)

    def forward(self, input_ids: torch.Tensor, real: torch.Tensor | None) -> torch.Tensor:
        """input_ids [batch, steps] -> hidden [batch, steps, width]. ``real`` [batch, steps] is True at
        real tokens and False at padding, or None when no row is padded."""
        # SDPA broadcasts a [batch, 1, 1, steps] mask over heads and queries: no query attends to padding.
        # None lets it pick its fastest kernel, as transformers does for an unpadded batch.
        key_mask = None if real is None else real[:, None, None, :]
        return self.encoder(self.embeddings(input_ids), key_mask)


class Embeddings(nn.Module):
    def __init__(self, shape: BertShape) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(shape.vocab, shape.width)
        self.position_embeddings = nn.Embedding(shape.positions, shape.width)
        self.token_type_embeddings = nn.Embedding(shape.token_types, shape.width)
        self.LayerNorm = nn.LayerNorm(shape.width, eps=shape.eps)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        # Every token is of type 0 (one sentence, no pair); summed in transformers' order.
        hidden = self.word_embeddings(input_ids) + self.token_type_embeddings.weight[0]
        hidden = hidden + self.position_embeddings(positions)
        return self.LayerNorm(hidden)


class LayerStack(nn.Module):
    def __init__(self, shape: BertShape) -> None:
        super().__init__()
        self.layer = nn.ModuleList(Layer(shape) for _ in range(shape.layers))

    def forward(self, hidden: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        for layer in self.layer:
            hidden = layer(hidden, key_mask)
        return hidden


class Layer(nn.Module):
    """Self-attention, then the feed-forward block, each followed by a residual LayerNorm (post-norm)."""

    def __init__(self, shape: BertShape) -> None:
        super().__init__()
        self.attention = Attention(shape)
        self.intermediate = Intermediate(shape)
        self.output = ResidualNorm(shape.inner, shape.width, shape.eps)

    def forward(self, hidden: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        attended = self.attention(hidden, key_mask)
        return self.output(self.intermediate(attended), attended)


class Attention(nn.Module):
    def __init__(self, shape: BertShape) -> None:
        super().__init__()
        self.self = SelfAttention(shape)
        self.output = ResidualNorm(shape.width, shape.width, shape.eps)

    def forward(self, hidden: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        return self.output(self.self(hidden, key_mask), hidden)


class SelfAttention(nn.Module):
    def __init__(self, shape: BertShape) -> None:
        super().__init__()
        if shape.width % shape.heads:
            raise ValueError(
                f"hidden_size {shape.width} is not a multiple of num_attention_heads {shape.heads}"
            )
        self.heads = shape.heads
        self.query = nn.Linear(shape.width, shape.width)
        self.key = nn.Linear(shape.width, shape.width)
        self.value = nn.Linear(shape.width, shape.width)

    def forward(self, hidden: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        batch, steps, width = hidden.shape

        def split(projected: torch.Tensor) -> torch.Tensor:  # [b, t, w] -> [b, heads, t, w / heads]
            return projected.view(batch, steps, self.heads, width // self.heads).transpose(1, 2)

        attended = F.scaled_dot_product_attention(
            split(self.query(hidden)), split(self.key(hidden)), split(self.value(hidden)), attn_mask=key_mask
        )
        return attended.transpose(1, 2).reshape(batch, steps, width)


class Intermediate(nn.Module):
    def __init__(self, shape: BertShape) -> None:
        super().__init__()
        self.dense = nn.Linear(shape.width, shape.inner)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.dense(hidden))  # exact (erf) GELU: config.json's "gelu"


class ResidualNorm(nn.Module):
    """A projection back to the residual width, added to the residual, then LayerNorm."""

    def __init__(self, width_in: int, width: int, eps: float) -> None:
        super().__init__()
        self.dense = nn.Linear(width_in, width)
        self.LayerNorm = nn.LayerNorm(width, eps=eps)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(hidden) + residual)
