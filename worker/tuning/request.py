"""What `batchwork tune` was asked: the request, its flags parsed and checked, and the one error type
whose message a user sees as one line (exit code 2).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from worker.errors import UsageError
from worker.models.base import InvalidInput, Model
from worker.models.precision import PRECISIONS
from worker.models.registry import model_class
from worker.settings import DAY_MS, Settings
from worker.tuning.measure import Pacing


class TuneError(UsageError):
    """A mistake in the command line or its files; the message is the one line the user sees."""


@dataclass(frozen=True)
class TuneRequest:
    model: str
    max_batch_ms: float
    memory_fraction: float = 0.9
    lengths: tuple[int, ...] | None = None  # None: auto
    sample: Path | None = None
    precisions: tuple[str, ...] = ()  # empty: the model's configured precision only
    apply: bool = False
    max_n: int = 1024
    pacing: Pacing = field(default_factory=Pacing)
    backends: tuple[str, ...] = ()  # empty: the model's configured backend only
    min_cosine: float = 0.9999  # --apply of a backend sweep stores only a pair at least this close to fp32


def parse_lengths(text: str) -> tuple[int, ...] | None:
    if text == "auto":
        return None
    try:
        lengths = tuple(sorted({int(part) for part in text.split(",")}))
    except ValueError:
        raise TuneError(
            f"--lengths must be 'auto' or comma-separated token counts like 16,64,256, not {text!r}"
        ) from None
    if not lengths or lengths[0] < 1:
        raise TuneError("--lengths: every length must be at least 1 token")
    return lengths


def parse_precisions(text: str | None) -> tuple[str, ...]:
    if not text:
        return ()
    names = tuple(dict.fromkeys(part.strip() for part in text.split(",")))
    unknown = [name for name in names if name not in PRECISIONS]
    if unknown:
        raise TuneError(f"--precisions: unknown {', '.join(unknown)}; use some of {', '.join(PRECISIONS)}")
    return names


def check_request(request: TuneRequest, settings: Settings) -> type[Model]:
    if not 0 < request.max_batch_ms <= DAY_MS:  # so, too, never NaN nor infinite (each compares false)
        raise TuneError(f"--max-batch-ms must be above 0 and at most {DAY_MS} (a day)")
    if not 0 < request.memory_fraction <= 1:
        raise TuneError("--memory-fraction must be above 0 and at most 1")
    if request.max_n < 1:
        raise TuneError("--max-n must be at least 1")
    if request.sample is not None and not request.sample.is_file():
        raise TuneError(f"--sample {request.sample}: no such file")
    try:
        return model_class(request.model, settings)
    except InvalidInput as exc:
        raise TuneError(str(exc)) from None
