"""`batchwork tune MODEL --backends torch,onnx --precisions fp32,int8`: every backend and precision pair of an
embed or classify model swept the same way, its items/s beside how far its outputs stay from torch fp32's on
the sample (minimum cosine; for classify also the largest score difference); ``--apply`` stores the fastest
pair that meets ``--min-cosine``, with its batching limits, for this device kind.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from worker.models.base import Model
from worker.models.precision import UnsupportedPrecision
from worker.settings import Settings
from worker.tuning.choice import choose
from worker.tuning.curve import Point
from worker.tuning.measure import Bench
from worker.tuning.precision_check import SYNTHETIC_TEXTS, min_cosine, outputs, synthetic_texts
from worker.tuning.request import TuneError, TuneRequest

BACKENDS = ("torch", "onnx")
REFERENCE = ("torch", "fp32")


def parse_backends(text: str | None) -> tuple[str, ...]:
    if not text:
        return ()
    names = tuple(dict.fromkeys(part.strip() for part in text.split(",")))
    unknown = [name for name in names if name not in BACKENDS]
    if unknown:
        raise TuneError(f"--backends: unknown {', '.join(unknown)}; use some of {', '.join(BACKENDS)}")
    return names


def label(backend: str, precision: str) -> str:
    return f"{backend}/{precision}"


def with_backend(settings: Settings, cls: type[Model], backend: str, precision: str) -> Settings:
    """The settings with ``cls``'s options block set to this backend and precision (other options kept)."""
    block = {**settings.model_options.get(cls.name, {}), "backend": backend, "precision": precision}
    return settings.model_copy(update={"model_options": {**settings.model_options, cls.name: block}})


def load_pairs(
    cls: type[Model], settings: Settings, device: str, pairs: Sequence[tuple[str, str]]
) -> dict[tuple[str, str], Model | str]:
    """Each pair loaded, or why it cannot run here (a note, not an error: the other pairs still run)."""
    if "backend" not in cls.Options.model_fields:
        raise TuneError(
            f"--backends: {cls.name} has one backend; --backends is for embed and classify models"
        )
    loaded: dict[tuple[str, str], Model | str] = {}
    for backend, precision in pairs:
        model = cls(with_backend(settings, cls, backend, precision))
        try:
            model.load(device)
        except UnsupportedPrecision as exc:
            loaded[(backend, precision)] = f"skipped: {exc}"
            continue
        ran = getattr(model, "backend", backend)
        loaded[(backend, precision)] = model if ran == backend else f"skipped: {backend} fell back to {ran}"
    return loaded


def compare(
    models: dict[tuple[str, str], Model | str],
    reference: Model,
    points: Sequence[Point],
    request: TuneRequest,
    memory_cap: int | None,
    sample: Sequence[object],
) -> list[dict[str, Any]]:
    """One row per pair: the normal lane's N and items/s, min cosine (and max score difference) vs torch
    fp32."""
    items = list(sample) or synthetic_texts(SYNTHETIC_TEXTS)
    expected = outputs(reference, items)
    rows: list[dict[str, Any]] = []
    for (backend, precision), model in models.items():
        row: dict[str, Any] = {"backend": backend, "precision": precision}
        if isinstance(model, str):
            rows.append(row | {"note": model})
            continue
        mine = [p for p in points if p.precision == label(backend, precision)]
        normal = choose(mine, request.max_batch_ms, memory_cap)["normal"]
        got = outputs(model, items)
        row |= {
            "max_batch_size": normal.max_batch_size,
            "items_per_s": None if normal.items_per_s is None else round(normal.items_per_s, 1),
            "min_cosine": round(min_cosine(expected, got), 6),
        }
        if reference.kind == "classify":
            row["max_score_diff"] = float(f"{np.max(np.abs(expected - got)):.3g}")
        rows.append(row)
    base = next((r.get("items_per_s") for r in rows if (r["backend"], r["precision"]) == REFERENCE), None)
    for row in rows:
        if base and row.get("items_per_s"):
            row["speedup"] = round(row["items_per_s"] / base, 3)
    return rows


def best(rows: Sequence[dict[str, Any]], min_cos: float) -> dict[str, Any] | None:
    """The fastest pair whose minimum cosine meets the bound."""
    fit = [r for r in rows if r.get("items_per_s") and r.get("min_cosine", 0) >= min_cos]
    return max(fit, key=lambda r: r["items_per_s"], default=None)


def bench_pairs(
    models: dict[tuple[str, str], Model | str], device: str, request: TuneRequest
) -> dict[str, Bench]:
    return {
        label(*pair): Bench(model, device, request.pacing, label(*pair))
        for pair, model in models.items()
        if isinstance(model, Model)
    }


def print_backends(console: Console, rows: Sequence[dict[str, Any]], chosen: dict[str, Any] | None) -> None:
    table = Table(
        "backend",
        "precision",
        "N",
        "items/s",
        "vs torch fp32",
        "min cosine",
        "max score diff",
        "note",
        title="backends (outputs vs torch fp32 on the sample)",
    )
    for row in rows:
        mark = " *" if chosen is row else ""
        table.add_row(
            row["backend"] + mark,
            row["precision"],
            _cell(row.get("max_batch_size")),
            _cell(row.get("items_per_s"), ",.0f"),
            _cell(row.get("speedup"), ".2f"),
            _cell(row.get("min_cosine"), ".6f"),
            _cell(row.get("max_score_diff"), ".2g"),
            row.get("note", ""),
        )
    console.print(table)


def _cell(value: Any, spec: str = "") -> str:
    return "-" if value is None else format(value, spec)
