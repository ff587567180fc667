"""What production ran, read back: run time ~ a + b * padded tokens fitted by least squares over stored
batches, and the rate at which items arrived in each lane.

Pure arithmetic on plain numbers (numpy); the caller reads the rows. Never imports torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# The fit's prediction must stay this many residual standard deviations under the bound to "meet" it.
MARGIN_SIGMAS = 2.0


@dataclass(frozen=True, slots=True)
class CostFit:
    """run_ms ~ a_ms + b_ms_per_token * padded_tokens over ``rows`` batches."""

    a_ms: float
    b_ms_per_token: float
    rmse_ms: float  # root mean square of the residuals
    r2: float
    rows: int

    def predict_ms(self, padded_tokens: float) -> float:
        return self.a_ms + self.b_ms_per_token * padded_tokens

    def meets(self, padded_tokens: float, bound_ms: float) -> bool:
        return self.predict_ms(padded_tokens) + MARGIN_SIGMAS * self.rmse_ms <= bound_ms


class NotEnoughHistory(ValueError):
    """Too few stored batches, or all of one size, to fit a line."""


def fit_cost(padded_tokens: Sequence[float], run_ms: Sequence[float]) -> CostFit:
    x = np.asarray(padded_tokens, dtype=float)
    y = np.asarray(run_ms, dtype=float)
    if len(x) < 3 or np.ptp(x) == 0:
        raise NotEnoughHistory(
            f"{len(x)} stored batches of {len(set(x.tolist()))} distinct sizes: a fit needs at least 3 "
            "batches of at least 2 sizes"
        )
    design = np.column_stack([np.ones_like(x), x])
    (a, b), *_ = np.linalg.lstsq(design, y, rcond=None)
    residuals = y - (a + b * x)
    total = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - float(np.sum(residuals**2)) / total if total > 0 else 1.0
    return CostFit(float(a), float(b), float(np.sqrt(np.mean(residuals**2))), r2, len(x))


def arrival_per_s(sizes: Sequence[int], started_s: Sequence[float]) -> float | None:
    """Items per second over the span of these batches (one lane's), or None when the span is empty."""
    if len(sizes) < 2:
        return None
    span = max(started_s) - min(started_s)
    if span <= 0:
        return None
    # The last batch's items arrived within the span too, but the first's before it: leave one batch out.
    return (sum(sizes) - sizes[int(np.argmin(started_s))]) / span
