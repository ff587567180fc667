"""`batchwork tune MODEL`: load the model on the worker's device, sweep N per length (and precision),
choose per lane, print or write the result, and with ``--apply`` store it for every worker.

User mistakes raise TuneError (one line, exit 2 in the CLI); nothing here prints a traceback.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

from worker.models.base import InvalidInput, Model, StepModel
from worker.models.precision import UnsupportedPrecision
from worker.settings import DAY_S, Settings
from worker.tuning import report
from worker.tuning.choice import choose
from worker.tuning.curve import Point
from worker.tuning.measure import Bench, Pacing, free_memory_bytes, prepared_lengths, with_precision
from worker.tuning.request import TuneError, TuneRequest, check_request, parse_lengths, parse_precisions
from worker.tuning.result import apply_choice, build_result, read_history
from worker.tuning.sweep import progress_bar, sweep_lengths

# Without a sample, lengths that stand for short, medium and long texts (clipped to the model's maximum).
AUTO_LENGTHS = (16, 64, 256)


def tune(request: TuneRequest, settings: Settings, console: Console) -> tuple[dict[str, Any], list[Point]]:
    """Sweep, choose and (with ``apply``) store; returns the JSON result and every measured point."""
    from worker.models.device import device_kind, resolve_device
    from worker.tuning import precision_check

    cls = check_request(request, settings)
    if issubclass(cls, StepModel):
        from worker.tuning.steps import tune_steps

        return tune_steps(request, cls, settings, console)
    device = resolve_device(settings.device)
    kind = device_kind(device)
    if request.backends:
        return _tune_backends(request, cls, settings, console, device, kind)
    configured = cls.options_from(settings.model_options.get(cls.name, {})).precision
    precisions = request.precisions or (configured,)
    sample = _sample_items(request, settings)
    loaded = [_load(cls, settings, p, device) for p in precisions]
    runnable = [(p, model) for p, model in zip(precisions, loaded, strict=True) if isinstance(model, Model)]
    if not runnable:
        raise TuneError("; ".join(str(model) for model in loaded))
    memory_cap = _memory_cap(device, request.memory_fraction)
    lengths = _lengths(request, cls, runnable[0][1], sample)
    points: list[Point] = []
    with progress_bar(console) as progress:
        for precision, model in runnable:
            bench = Bench(model, device, request.pacing, precision)
            points += sweep_lengths(bench.measure, lengths, request, progress, precision)
    primary = runnable[0][0]
    rates, tuned = read_history(settings, request.model, kind)
    mine = [p for p in points if p.precision == primary]
    lanes = choose(mine, request.max_batch_ms, memory_cap, rates)
    result = build_result(request, cls, device, kind, primary, memory_cap, lanes, mine, tuned)
    if len(precisions) > 1:
        models = dict(zip(precisions, loaded, strict=True))
        result["precisions"] = precision_check.compare(
            cls, settings, device, models, points, request.max_batch_ms, memory_cap, sample
        )
    if request.apply:
        apply_choice(settings, request.model, kind, lanes, result)
    return result, points


def _tune_backends(
    request: TuneRequest, cls: type[Model], settings: Settings, console: Console, device: str, kind: str
) -> tuple[dict[str, Any], list[Point]]:
    """Each backend x precision pair swept; the fastest that meets --min-cosine is the choice (and stored
    with --apply, its backend and precision beside its limits)."""
    from worker.tuning import backends

    configured = cls.options_from(settings.model_options.get(cls.name, {})).precision
    pairs = [(b, p) for b in request.backends for p in (request.precisions or (configured,))]
    sample = _sample_items(request, settings)
    models = backends.load_pairs(cls, settings, device, pairs)
    runnable = [model for model in models.values() if isinstance(model, Model)]
    if not runnable:
        raise TuneError("; ".join(str(model) for model in models.values()))
    reference = models.get(backends.REFERENCE)
    if not isinstance(reference, Model):
        reference = backends.load_pairs(cls, settings, device, [backends.REFERENCE])[backends.REFERENCE]
    if not isinstance(reference, Model):
        raise TuneError(f"torch fp32 (the reference) cannot run: {reference}")
    memory_cap = _memory_cap(device, request.memory_fraction)
    lengths = _lengths(request, cls, runnable[0], sample)
    points: list[Point] = []
    with progress_bar(console) as progress:
        for name, bench in backends.bench_pairs(models, device, request).items():
            points += sweep_lengths(bench.measure, lengths, request, progress, name)
    rows = backends.compare(models, reference, points, request, memory_cap, sample)
    chosen = backends.best(rows, request.min_cosine)
    first = next(row for row in rows if "note" not in row)
    picked = chosen or first
    mine = [p for p in points if p.precision == backends.label(picked["backend"], picked["precision"])]
    rates, tuned = read_history(settings, request.model, kind)
    lanes = choose(mine, request.max_batch_ms, memory_cap, rates)
    result = build_result(request, cls, device, kind, picked["precision"], memory_cap, lanes, mine, tuned)
    result |= {"backend": picked["backend"], "backends": rows, "min_cosine": request.min_cosine}
    if request.apply:
        if chosen is None:
            raise TuneError(
                f"--apply: no backend and precision met --min-cosine {request.min_cosine}; nothing stored"
            )
        apply_choice(settings, request.model, kind, lanes, result)
    return result, points


def _load(cls: type[Model], settings: Settings, precision: str, device: str) -> Model | UnsupportedPrecision:
    model = cls(with_precision(settings, cls, precision))
    try:
        model.load(device)
    except UnsupportedPrecision as exc:
        return UnsupportedPrecision(f"{precision}: {exc}")
    return model


def _sample_items(request: TuneRequest, settings: Settings) -> list[object]:
    if request.sample is None:
        return []
    from worker.calls import check_item
    from worker.jsonl import InputFileError, read_inputs
    from worker.models.registry import model_class

    try:
        items = read_inputs(request.sample, settings.max_items_per_job)
        cls = model_class(request.model, settings)
        # What the model's prepare takes: each item as its check returns it.
        return [check_item(cls, index, item, settings)[0] for index, item in enumerate(items)]
    except InvalidInput as exc:
        raise TuneError(f"--sample {items.line_of(exc.index)}: {exc.detail}") from None
    except InputFileError as exc:
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


def _memory_cap(device: str, fraction: float) -> int | None:
    free = free_memory_bytes(device)
    return None if free is None else int(free * fraction)


def print_result(console: Console, result: dict[str, Any], points: list[Point]) -> None:
    report.print_points(console, points, result)
    report.print_choice(console, result)
    if "precisions" in result:
        report.print_precisions(console, result["precisions"])
    if "backends" in result:
        from worker.tuning.backends import print_backends

        chosen = next(
            (
                r
                for r in result["backends"]
                if (r["backend"], r["precision"]) == (result["backend"], result["precision"])
            ),
            None,
        )
        print_backends(console, result["backends"], chosen)
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
    backends: str | None = None,
    min_cosine: float = 0.9999,
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

    if not 0 < point_s <= DAY_S:  # NaN and infinity too
        raise TuneError(f"--point-s must be above 0 and at most {DAY_S} (a day)")
    from worker.tuning.backends import parse_backends

    if from_history and (apply or precisions or backends):
        raise TuneError("--from-history measures nothing: --apply and --precisions go with a sweep")
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
        parse_backends(backends),
        min_cosine,
    )
    if output_dir is not None:
        report.check_output_dir(output_dir)
    settings = get_settings()
    if from_history:
        from worker.tuning.fitted import from_history as fit_history

        check_request(request, settings)
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
