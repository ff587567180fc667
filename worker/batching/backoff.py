"""How large a model's batches may be after running out of memory: down at once, back up slowly.

Pure arithmetic on batch sizes (additive increase, multiplicative decrease); the runner reports
what happened and the scheduler applies the resulting cap. Never imports an edge of the system.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SizeLimit:
    """The largest batch a model is trusted with now; None means its configured N."""

    grow_after: int = 20  # successful batches at the cap before trying a larger one
    cap: int | None = None
    _proven: int = 0  # the largest batch that ran since the last out-of-memory error
    _successes: int = 0

    def ran_out_of_memory(self, size: int, largest_ok: int) -> None:
        """A batch of ``size`` ran out of memory; sub-batches of ``largest_ok`` ran (0: none did)."""
        probing = self.cap is not None and self._proven and self._proven < size
        if probing:
            # A larger size was tried and failed: go back to what worked, and probe less often.
            self.grow_after = min(self.grow_after * 2, 10_000)
        self.cap = (
            max(1, largest_ok, self._proven if probing else 0) if largest_ok or probing else max(1, size // 2)
        )
        self._proven = largest_ok
        self._successes = 0

    def succeeded(self, size: int, configured: int) -> None:
        self._proven = max(self._proven, size)
        if self.cap is None or size < self.cap:
            return
        self._successes += 1
        if self._successes < self.grow_after:
            return
        self._successes = 0
        grown = self.cap + max(1, self.cap // 8)
        self.cap = None if grown >= configured else grown
