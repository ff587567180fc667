"""Text generation with any causal LM transformers loads (``generate:/dir``; ``gpt2``, worker/models/gpt2/,
is this kind over its ``path`` with a network of its own),
continuously batched over our paged KV cache.

model.py drives generation step by step; network.py loads the checkpoint and runs its forwards; attention.py
is the paged attention plugged into transformers' attention interface; cache.py the paged KV pool;
inputs.py the request checks (no torch); sampling.py the per-sequence token choice. Which sequences run,
join or give pages back each step is the pure core's (worker/batching/sequences.py).
"""

from worker.models.causal_lm.model import CausalLM

__all__ = ["CausalLM"]
