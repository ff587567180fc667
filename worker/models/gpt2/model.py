"""gpt2: the generate kind's step loop over the hand-written GPT-2 network (network.py).

It must never import torch at module import (only ``load_network`` does) and adds nothing to what the
generate kind does but the network: the same inputs, outputs, options and scheduling.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, cast

from worker.models.causal_lm.model import CausalLM, CausalLMOptions

if TYPE_CHECKING:
    from worker.models.causal_lm.model import Forwards
    from worker.models.causal_lm.network import Shape
    from worker.settings import Settings


class GPT2Options(CausalLMOptions):
    """gpt2's block of BATCHWORK_MODEL_OPTIONS: the generate kind's options and the checkpoint's ``path``."""

    # A local GPT-2-format checkpoint directory; never downloaded.
    path: str | None = None


class GPT2(CausalLM):
    """GPT-2 text generation (greedy or seeded sampling) from the directory its ``path`` option names."""

    name = "gpt2"
    Options = GPT2Options

    @classmethod
    def checkpoint_path(cls, settings: Settings) -> str | None:
        return cast(GPT2Options, cls.options_from(settings.model_options.get(cls.name, {}))).path

    @classmethod
    def checkpoint_dir(cls, settings: Settings) -> Path:
        setting = cls.checkpoint_path(settings)
        if not setting:
            raise RuntimeError(f"the gpt2 model has no checkpoint: {GPT2_SETUP}")
        if not (Path(setting).expanduser() / "config.json").is_file():
            raise FileNotFoundError(f"gpt2's path {setting!r} has no config.json: {GPT2_SETUP}")
        return Path(setting).expanduser()

    def load_network(self, checkpoint: Path, device: str) -> tuple[Forwards, Shape]:
        """The checkpoint's weights in our plain-torch GPT-2, in the ``precision`` option's dtype."""
        from worker.models.gpt2.network import GPT2Network, NotGPT2, read_shape, read_weights

        try:
            shape = read_shape(checkpoint)
        except NotGPT2:
            # Another architecture under gpt2's path runs as any generate: entry does, as it did before.
            return super().load_network(checkpoint, device)
        pool = self.kv_pool(shape.layers, shape.heads, shape.head_dim, device)
        network = GPT2Network(shape, read_weights(checkpoint), pool, device)
        return network, network.layout


GPT2_SETUP = (
    'set BATCHWORK_MODEL_OPTIONS=\'{"gpt2": {"path": "/models/gpt2"}}\' to a local Hugging Face GPT-2-format '
    "directory (config.json, model.safetensors or pytorch_model.bin, tokenizer files)"
)
