"""Precision beside throughput: per precision, the normal lane's items/s and how close its outputs stay
to fp32's on the sample (minimum cosine for embeddings), so a user chooses with both numbers in front.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from worker.models.base import Model
from worker.models.precision import UnsupportedPrecision
from worker.settings import Settings
from worker.tuning.choice import choose
from worker.tuning.curve import Point
from worker.tuning.measure import WORDS, with_precision

COMPARE_BATCH = 16
SYNTHETIC_TEXTS = 64


def compare(
    cls: type[Model],
    settings: Settings,
    device: str,
    models: Mapping[str, Model | UnsupportedPrecision],
    points: Sequence[Point],
    max_batch_ms: float,
    memory_cap: int | None,
    sample: Sequence[object],
) -> list[dict[str, Any]]:
    items = list(sample) or synthetic_texts(SYNTHETIC_TEXTS)
    reference_model = models.get("fp32")
    if not isinstance(reference_model, Model):
        reference_model = _fp32(cls, settings, device)
    reference = outputs(reference_model, items)
    rows: list[dict[str, Any]] = []
    for precision, model in models.items():
        if not isinstance(model, Model):
            rows.append({"precision": precision, "note": f"skipped: {model}"})
            continue
        normal = choose([p for p in points if p.precision == precision], max_batch_ms, memory_cap)["normal"]
        rows.append(
            {
                "precision": precision,
                "max_batch_size": normal.max_batch_size,
                "items_per_s": None if normal.items_per_s is None else round(normal.items_per_s, 1),
                "min_cosine": round(min_cosine(reference, outputs(model, items)), 6),
            }
        )
    base = next((r.get("items_per_s") for r in rows if r["precision"] == "fp32"), None)
    for row in rows:
        if base and row.get("items_per_s"):
            row["speedup"] = round(row["items_per_s"] / base, 3)
    return rows


def _fp32(cls: type[Model], settings: Settings, device: str) -> Model:
    model = cls(with_precision(settings, cls, "fp32"))
    model.load(device)
    return model


def outputs(model: Model, items: Sequence[object]) -> np.ndarray:
    payloads = [p.payload for p in model.prepare(list(items))]
    rows: list[Any] = []
    for start in range(0, len(payloads), COMPARE_BATCH):
        rows += model.forward(payloads[start : start + COMPARE_BATCH])
    if rows and isinstance(rows[0], dict) and "scores" in rows[0]:  # classify: the score vectors
        rows = [list(row["scores"].values()) for row in rows]
    return np.asarray(rows, dtype=np.float64)


def min_cosine(reference: np.ndarray, other: np.ndarray) -> float:
    """The lowest cosine similarity between matching rows (1.0: identical directions)."""
    if reference.ndim == 1:  # scalar outputs: compare them as 1-d vectors
        reference, other = reference[:, None], other[:, None]
    dots = np.sum(reference * other, axis=1)
    norms = np.linalg.norm(reference, axis=1) * np.linalg.norm(other, axis=1)
    return float(np.min(np.where(norms > 0, dots / np.maximum(norms, 1e-30), 1.0)))


def synthetic_texts(count: int) -> list[str]:
    """Deterministic texts of 3 to about 200 words, for when no --sample is given."""
    return [
        " ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(3 + (i * 37) % 200)) for i in range(count)
    ]
