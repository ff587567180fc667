"""gpt2: the generate kind's step loop over the hand-written GPT-2 network (network.py).

It must never import torch at module import (only ``load_network`` does) and adds nothing to what the
generate kind does but the network: the same inputs, outputs, options and scheduling.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, cast

from worker.models.causal_lm import model as causal_lm
from worker.models.causal_lm.model import PAGE_TOKENS, CausalLMOptions

if TYPE_CHECKING:
    from worker.models.causal_lm.model import Forwards
    from worker.models.causal_lm.network import Shape


class GPT2(causal_lm.GPT2):
    """GPT-2 text generation (greedy or seeded sampling) from the directory its ``path`` option names."""

    def load_network(self, checkpoint: Path, device: str) -> tuple[Forwards, Shape]:
        """The checkpoint's weights in our plain-torch GPT-2, in the ``precision`` option's dtype."""
        from worker.models.causal_lm.cache import PagePool
        from worker.models.causal_lm.network import DTYPES
        from worker.models.gpt2.network import GPT2Network, NotGPT2, read_shape, read_weights

        options = cast(CausalLMOptions, self.options())
        try:
            shape = read_shape(checkpoint)
        except NotGPT2:
            # Another architecture under gpt2's path runs as any generate: entry does, as it did before.
            return super().load_network(checkpoint, device)
        pool = PagePool(
            layers=shape.layers,
            heads=shape.heads,
            head_dim=shape.head_dim,
            pages=options.kv_budget_tokens // PAGE_TOKENS,
            page_tokens=PAGE_TOKENS,
            dtype=DTYPES[options.precision],
            device=device,
        )
        network = GPT2Network(shape, read_weights(checkpoint), pool, device)
        return network, network.layout
