"""The plain-torch BERT encoder's loading, on a tiny random checkpoint: every weight lands where its name
says, and a config or checkpoint it cannot honour is refused in one line instead of computing garbage.
(Its outputs are checked against sentence-transformers on the real MiniLM in tests/integration.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from worker.models.bert_encoder import BertEncoder, load_encoder, read_shape

CONFIG = {
    "hidden_act": "gelu",
    "hidden_size": 8,
    "intermediate_size": 16,
    "layer_norm_eps": 1e-12,
    "max_position_embeddings": 16,
    "num_attention_heads": 2,
    "num_hidden_layers": 2,
    "type_vocab_size": 2,
    "vocab_size": 30,
}


def write_checkpoint(directory: Path, tensors: dict[str, torch.Tensor], **config: object) -> Path:
    (directory / "config.json").write_text(json.dumps(CONFIG | config))
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


def random_weights(directory: Path, prefix: str = "") -> dict[str, torch.Tensor]:
    """A random encoder's tensors as a checkpoint names them, with the pooler and position_ids beside."""
    (directory / "config.json").write_text(json.dumps(CONFIG))
    tensors = {
        prefix + name: tensor.clone()
        for name, tensor in BertEncoder(read_shape(directory)).state_dict().items()
    }
    tensors[prefix + "pooler.dense.weight"] = torch.randn(8, 8)
    tensors[prefix + "pooler.dense.bias"] = torch.randn(8)
    tensors[prefix + "embeddings.position_ids"] = torch.arange(16)[None]
    return tensors


@pytest.mark.parametrize("prefix", ["", "bert."])
def test_every_weight_lands_under_its_own_name(tmp_path: Path, prefix: str) -> None:
    tensors = random_weights(tmp_path, prefix)
    encoder = load_encoder(write_checkpoint(tmp_path, tensors))
    loaded = encoder.state_dict()
    assert len(loaded) == len(tensors) - 3  # all but the pooler and position_ids
    for name, tensor in loaded.items():
        assert torch.equal(tensor, tensors[prefix + name]), name
    hidden = encoder(torch.tensor([[1, 5, 7, 0]]), torch.tensor([[True, True, True, False]]))
    assert hidden.shape == (1, 4, 8)


def test_a_missing_weight_fails_the_load(tmp_path: Path) -> None:
    tensors = random_weights(tmp_path)
    del tensors["encoder.layer.1.output.dense.weight"]
    with pytest.raises(RuntimeError, match="Missing key.*encoder.layer.1.output.dense.weight"):
        load_encoder(write_checkpoint(tmp_path, tensors))


def test_an_unknown_weight_fails_the_load(tmp_path: Path) -> None:
    tensors = random_weights(tmp_path) | {"cls.predictions.bias": torch.zeros(30)}
    with pytest.raises(RuntimeError, match="Unexpected key.*cls.predictions.bias"):
        load_encoder(write_checkpoint(tmp_path, tensors))


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"hidden_act": "gelu_new"}, "hidden_act 'gelu_new' is not the exact"),
        ({"hidden_act": "relu"}, "hidden_act 'relu'"),
        ({"position_embedding_type": "relative_key"}, "position_embedding_type 'relative_key'"),
        ({"num_attention_heads": 3}, "hidden_size 8 is not a multiple of num_attention_heads 3"),
    ],
)
def test_a_config_it_cannot_honour_is_refused(
    tmp_path: Path, config: dict[str, object], message: str
) -> None:
    tensors = random_weights(tmp_path)
    with pytest.raises(ValueError, match=message):
        load_encoder(write_checkpoint(tmp_path, tensors, **config))
