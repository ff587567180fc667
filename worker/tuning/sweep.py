"""One sweep of a batch curve with a progress bar: every prompt length's points, the point being measured
shown as it runs. Shared by the batch sweep (command.py) and the step sweep (steps.py); it measures
nothing itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from worker.tuning.choice import lane_bounds
from worker.tuning.curve import Point, sweep_length
from worker.tuning.request import TuneRequest


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


def progress_bar(console: Console) -> Progress:
    columns = (
        SpinnerColumn(),
        TextColumn("{task.description}"),
        TextColumn("{task.completed} points"),
        TimeElapsedColumn(),
    )
    return Progress(*columns, console=console, transient=False)
