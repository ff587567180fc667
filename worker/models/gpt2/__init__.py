"""``gpt2``: the generate kind over the checkpoint its ``path`` option names, its forwards our own plain-torch
GPT-2 (network.py) in place of transformers' model (measured faster on the same requests).

Everything else (requests, tokenizing, chat templates, stop strings, sampling, the paged KV cache, the
scheduler's preemption) is the generate kind's, worker/models/causal_lm/.
"""

from worker.models.gpt2.model import GPT2

__all__ = ["GPT2"]
