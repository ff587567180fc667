"""A stand-in for a GPU model: each batch of n items takes ``a + b*n`` ms and returns checkable outputs.

It must never do real work: it sleeps (releasing the GIL, as a GPU kernel would) so batching can be
tested and benchmarked without weights.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from worker.models.base import Model


class Simulated(Model):
    """Sleeps a + b*n ms per batch (a GPU's cost shape) and returns each text's length in characters."""

    name = "simulated"
    max_batch_size = 64
    max_wait_ms = 20.0

    def forward(self, payloads: Sequence[str]) -> list[int]:
        cost_ms = self.settings.simulated_base_ms + self.settings.simulated_per_item_ms * len(payloads)
        time.sleep(cost_ms / 1000.0)
        return [len(text) for text in payloads]
