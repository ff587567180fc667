"""`batchwork tune MODEL`: load the model on the worker's device, sweep N per length (and precision),
choose per lane, print or write the result, and with ``--apply`` store it for every worker.

User mistakes raise TuneError (one line, exit 2 in the CLI); nothing here prints a traceback.
"""

from __future__ import annotations

import getpass
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from worker.batching.policy import lane_policy
from worker.models.base import InvalidInput, Model, StepModel
from worker.models.precision import PRECISIONS, UnsupportedPrecision
from worker.models.registry import model_class
from worker.settings import PRIORITIES, ModelOptions, Settings
from worker.tuning import report
from worker.tuning.choice import LaneChoice, as_knobs, choose, knees, lane_bounds
from worker.tuning.curve import Point, sweep_length
from worker.tuning.history import arrival_per_s
from worker.tuning.limits import defaults_of, read_tuned
from worker.tuning.measure import Bench, Pacing, free_memory_bytes, prepared_lengths

# Without a sample, lengths that stand for short, medium and long texts (clipped to the model's maximum).
AUTO_LENGTHS = (16, 64, 256)
ARRIVAL_WINDOW = timedelta(hours=1)  # the history the fill time T is read from


class TuneError(ValueError):
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


def check_request(request: TuneRequest) -> type[Model]:
    if request.max_batch_ms <= 0:
        raise TuneError("--max-batch-ms must be above 0")
    if not 0 < request.memory_fraction <= 1:
        raise TuneError("--memory-fraction must be above 0 and at most 1")
    if request.max_n < 1:
        raise TuneError("--max-n must be at least 1")
    if request.sample is not None and not request.sample.is_file():
        raise TuneError(f"--sample {request.sample}: no such file")
    try:
        return model_class(request.model)
    except InvalidInput as exc:
        raise TuneError(str(exc)) from None


def tune(request: TuneRequest, settings: Settings, console: Console) -> tuple[dict[str, Any], list[Point]]:
    """Sweep, choose and (with ``apply``) store; returns the JSON result and every measured point."""
    from worker.models.device import device_kind, resolve_device
    from worker.tuning import precision_check

    cls = check_request(request)
    if issubclass(cls, StepModel):
        from worker.tuning.steps import tune_steps

        return tune_steps(request, cls, settings, console)
    device = resolve_device(settings.device)
    kind = device_kind(device)
    configured = settings.model_options.get(request.model, ModelOptions()).precision
    precisions = request.precisions or (configured,)
    sample = _sample_items(request, settings)
    loaded = [_load(cls, settings, p, device) for p in precisions]
    runnable = [(p, model) for p, model in zip(precisions, loaded, strict=True) if isinstance(model, Model)]
    if not runnable:
        raise TuneError("; ".join(str(model) for model in loaded))
    memory_cap = _memory_cap(device, request.memory_fraction)
    lengths = _lengths(request, cls, runnable[0][1], sample)
    points: list[Point] = []
    with _progress(console) as progress:
        for precision, model in runnable:
            bench = Bench(model, device, request.pacing, precision)
            points += sweep_lengths(bench.measure, lengths, request, progress, precision)
    primary = runnable[0][0]
    rates, tuned = _history(settings, request.model, kind)
    mine = [p for p in points if p.precision == primary]
    lanes = choose(mine, request.max_batch_ms, memory_cap, rates)
    result = _result(request, cls, device, kind, primary, memory_cap, lanes, mine, tuned)
    if len(precisions) > 1:
        models = dict(zip(precisions, loaded, strict=True))
        result["precisions"] = precision_check.compare(
            cls, settings, device, models, points, request.max_batch_ms, memory_cap, sample
        )
    if request.apply:
        _apply(settings, request.model, kind, lanes, result)
    return result, points


def _load(cls: type[Model], settings: Settings, precision: str, device: str) -> Model | UnsupportedPrecision:
    options = {**settings.model_options, cls.name: ModelOptions(precision=precision)}  # type: ignore[arg-type]
    model = cls(settings.model_copy(update={"model_options": options}))
    try:
        model.load(device)
    except UnsupportedPrecision as exc:
        return UnsupportedPrecision(f"{precision}: {exc}")
    return model


def _sample_items(request: TuneRequest, settings: Settings) -> list[object]:
    if request.sample is None:
        return []
    from worker.jsonl import InputFileError, read_inputs

    try:
        return list(read_inputs(request.sample, request.model, settings))
    except (InputFileError, InvalidInput) as exc:
        raise TuneError(f"--sample: {exc}") from None


def _lengths(request: TuneRequest, cls: type[Model], model: Model, sample: Sequence[object]) -> list[int]:
    """Token lengths to sweep: given, else the sample's median, 90th and 99th percentile, else AUTO_LENGTHS;
    each rounded up to the model's bucket edge. Models without lengths have one length, 1."""
    if not cls.bucket_edges and cls.max_batch_tokens is None:
        return [1]
    if request.lengths is not None:
        return list(request.lengths)
    if sample:
        ordered = sorted(prepared_lengths(model, sample))
        wanted = [ordered[min(len(ordered) - 1, int(q * len(ordered)))] for q in (0.5, 0.9, 0.99)]
    else:
        wanted = list(AUTO_LENGTHS)
    longest = max(cls.bucket_edges, default=max(wanted))
    return sorted({min(longest, next((e for e in cls.bucket_edges if e >= w), w)) for w in wanted})


def sweep_lengths(
    measure: Callable[[int, int], Point],
    lengths: Sequence[int],
    request: TuneRequest,
    progress: Progress,
    label: str,
) -> list[Point]:
    """Every length's curve (curve.sweep_length), with the point being measured shown in the progress bar."""
    bounds = list(lane_bounds(request.max_batch_ms).values())
    task = progress.add_task(label, total=None)
    points: list[Point] = []
    for length in lengths:

        def measure_at(n: int, length: int = length) -> Point:
            progress.update(task, description=f"{label}: length {length}, N={n}")
            point = measure(n, length)
            progress.advance(task)
            return point

        points += sweep_length(measure_at, bounds_ms=bounds, max_n=request.max_n)
    progress.update(task, description=f"{label}: {len(points)} points")
    return points


def _progress(console: Console) -> Progress:
    columns = (
        SpinnerColumn(),
        TextColumn("{task.description}"),
        TextColumn("{task.completed} points"),
        TimeElapsedColumn(),
    )
    return Progress(*columns, console=console, transient=False)


def _memory_cap(device: str, fraction: float) -> int | None:
    free = free_memory_bytes(device)
    return None if free is None else int(free * fraction)


def _history(settings: Settings, model: str, kind: str) -> tuple[dict[str, float], Any]:
    """Arrival rate per lane over the last hour of stored batches, and this model's tuned row."""
    tuned = read_tuned(settings.database_url, kind)
    if isinstance(tuned, str):
        return {}, None
    from worker.store.tuned import TunedLimits

    store = TunedLimits.from_url(settings.database_url)
    try:
        rows = store.batches(model, ARRIVAL_WINDOW)
    finally:
        store.close()
    rates: dict[str, float] = {}
    for lane in PRIORITIES:
        mine = [row for row in rows if row.lane == lane]
        rate = arrival_per_s([r.size for r in mine], [r.started_at.timestamp() for r in mine])
        if rate:
            rates[lane] = rate
    return rates, tuned.get(model)


def _result(
    request: TuneRequest,
    cls: type[Model],
    device: str,
    kind: str,
    precision: str,
    memory_cap: int | None,
    lanes: dict[str, LaneChoice],
    points: Sequence[Point],
    tuned: Any,
) -> dict[str, Any]:
    lane_rows = {name: _lane_row(choice, cls) for name, choice in lanes.items()}
    normal = lane_rows["normal"]
    warnings = [
        f"lane {name}: no batch size met the {row['bound_ms']:g} ms bound"
        for name, row in lane_rows.items()
        if row["max_batch_size"] is None
    ]
    oom = None if tuned is None else tuned.oom_batch_size
    largest = max((row["max_batch_size"] or 0) for row in lane_rows.values())
    if oom is not None and largest >= oom:
        warnings.append(
            f"N {largest} is at or above {oom}, a batch size that ran out of memory on {tuned.oom_worker}"
        )
    return {
        "model": request.model,
        "device": device,
        "device_kind": kind,
        "precision": precision,
        "max_batch_ms": request.max_batch_ms,
        "memory_cap_bytes": memory_cap,
        **{
            key: normal[key]
            for key in ("max_batch_size", "max_batch_tokens", "max_wait_ms", "p99_batch_ms", "items_per_s")
        },
        "lengths": sorted({p.length for p in points}),
        "knee": {str(length): n for length, n in knees(points).items()},
        "lanes": lane_rows,
        "oom_batch_size": oom,
        "warnings": warnings,
        "points": len(points),
        "applied": request.apply,
    }


def _lane_row(choice: LaneChoice, cls: type[Model]) -> dict[str, Any]:
    default_wait_ms = lane_policy(defaults_of(cls), choice.lane).max_wait_s * 1000
    return {
        "bound_ms": choice.bound_ms,
        "max_batch_size": choice.max_batch_size,
        "max_batch_tokens": choice.max_batch_tokens,
        "max_wait_ms": default_wait_ms if choice.max_wait_ms is None else choice.max_wait_ms,
        "max_wait_from": "default" if choice.max_wait_ms is None else "history",
        "p99_batch_ms": None if choice.p99_batch_ms is None else round(choice.p99_batch_ms, 2),
        "items_per_s": None if choice.items_per_s is None else round(choice.items_per_s, 1),
        "length": choice.length,
        "per_length": {str(length): n for length, n in choice.per_length.items()},
    }


def _apply(
    settings: Settings, model: str, kind: str, lanes: dict[str, LaneChoice], result: dict[str, Any]
) -> None:
    from worker.store.schema import migrate
    from worker.store.tuned import TunedLimits

    if any(choice.max_batch_size is None for choice in lanes.values()):
        raise TuneError("--apply: some lane has no batch size within its bound; raise --max-batch-ms")
    if settings.database_url.startswith("sqlite"):
        migrate(settings.database_url)  # the embedded run's database is created on first use
    store = TunedLimits.from_url(settings.database_url)
    detail = {key: result[key] for key in ("max_batch_ms", "precision", "memory_cap_bytes", "lanes", "knee")}
    try:
        store.apply(model, kind, as_knobs(lanes), detail, f"{getpass.getuser()}@{socket.gethostname()}")
    except Exception as exc:
        raise TuneError(
            f"--apply: could not store the limits ({type(exc).__name__}: {exc}); run `batchwork migrate`?"
        ) from None
    finally:
        store.close()


def print_result(console: Console, result: dict[str, Any], points: list[Point]) -> None:
    report.print_points(console, points, result)
    report.print_choice(console, result)
    if "precisions" in result:
        report.print_precisions(console, result["precisions"])
    if result.get("kv_budget_tokens") is not None:
        console.print(f"KV-cache budget the memory cap holds: {result['kv_budget_tokens']} tokens")


def run_command(
    model: str,
    *,
    max_batch_ms: float,
    memory_fraction: float,
    lengths: str,
    sample: Path | None,
    precisions: str | None,
    apply: bool,
    from_history: bool,
    as_json: bool,
    output_dir: Path | None,
    max_n: int,
    point_s: float,
    console: Console,
) -> None:
    """The CLI's body: flags checked first (TuneError), then the sweep or the fit, then the outputs."""
    import json

    from worker.settings import get_settings

    if point_s <= 0:
        raise TuneError("--point-s must be above 0")
    request = TuneRequest(
        model,
        max_batch_ms,
        memory_fraction,
        parse_lengths(lengths),
        sample,
        parse_precisions(precisions),
        apply,
        max_n,
        Pacing(point_s=point_s),
    )
    settings = get_settings()
    if from_history:
        from worker.tuning.fitted import from_history as fit_history

        check_request(request)
        result, points = fit_history(request, settings), list[Point]()
    else:
        result, points = tune(request, settings, console)
    if output_dir is not None:
        for path in report.write_outputs(output_dir, points, result):
            console.print(f"wrote {path}", highlight=False)
    if as_json:
        print(json.dumps(result))
    elif from_history:
        from worker.tuning.fitted import print_fit

        print_fit(Console(), result)
    else:
        print_result(Console(), result, points)
    if apply:
        console.print(
            f"applied: workers on {result['device_kind']} take these limits within their refresh interval"
        )
