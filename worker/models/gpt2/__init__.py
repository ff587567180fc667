"""GPT-2-architecture text generation, continuously batched (``worker.models.gpt2:GPT2``).

model.py drives generation step by step; network.py is the plain-torch decoder; cache.py the paged KV pool;
inputs.py the request checks (no torch); sampling.py the per-sequence token choice. Which sequences run,
join or give pages back each step is the pure core's (worker/batching/sequences.py).
"""

from worker.models.gpt2.model import GPT2

__all__ = ["GPT2"]
