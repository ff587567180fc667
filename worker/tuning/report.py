"""What `batchwork tune` leaves for a person: a terminal table, and in ``-o DIR`` a CSV of every point,
the JSON and a PNG of throughput and p99 batch time against N per length (bound, knee, choice marked).

It only formats results; it never measures or chooses. matplotlib is imported (Agg, headless) only here.
"""

from __future__ import annotations

import csv
import json
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from worker.tuning.choice import by_length
from worker.tuning.curve import Point
from worker.tuning.request import TuneError

CSV_FIELDS = (
    "precision",
    "length",
    "n",
    "p50_ms",
    "p99_ms",
    "items_per_s",
    "tokens_per_s",
    "peak_bytes",
    "oom",
    "runs",
)


def point_row(point: Point) -> dict[str, Any]:
    return {
        "precision": point.precision,
        "length": point.length,
        "n": point.n,
        "p50_ms": None if point.oom else round(point.p50_ms, 3),
        "p99_ms": None if point.oom else round(point.p99_ms, 3),
        "items_per_s": round(point.items_per_s, 2),
        "tokens_per_s": round(point.tokens_per_s, 1),
        "peak_bytes": point.peak_bytes,
        "oom": point.oom,
        "runs": point.runs,
    }


def print_points(console: Console, points: Sequence[Point], result: Mapping[str, Any]) -> None:
    marks = _marks(result)
    table = Table(
        "length", "N", "p50 ms", "p99 ms", "items/s", "tokens/s", "peak MiB", "", title="batch curve"
    )
    for point in sorted(points, key=lambda p: (p.precision, p.length, p.n)):
        row = point_row(point)
        table.add_row(
            str(point.length),
            str(point.n),
            "OOM" if point.oom else f"{point.p50_ms:.1f}",
            "OOM" if point.oom else f"{point.p99_ms:.1f}",
            f"{row['items_per_s']:,.0f}",
            f"{row['tokens_per_s']:,.0f}",
            "-" if point.peak_bytes is None else f"{point.peak_bytes / 2**20:.1f}",
            ", ".join(marks.get((point.length, point.n), [])),
        )
    console.print(table)


def print_choice(console: Console, result: Mapping[str, Any]) -> None:
    table = Table(
        "lane", "bound ms", "N", "max_batch_tokens", "T ms", "p99 ms", "items/s", title=_title(result)
    )
    for name, lane in result["lanes"].items():
        table.add_row(
            name,
            f"{lane['bound_ms']:g}",
            _cell(lane["max_batch_size"]),
            _cell(lane["max_batch_tokens"]),
            f"{_cell(lane['max_wait_ms'])} ({lane['max_wait_from']})",
            _cell(lane["p99_batch_ms"], ".1f"),
            _cell(lane["items_per_s"], ",.0f"),
        )
    console.print(table)
    for warning in result.get("warnings", []):
        console.print(f"[yellow]warning:[/yellow] {warning}", highlight=False)


def print_precisions(console: Console, rows: Sequence[Mapping[str, Any]]) -> None:
    table = Table(
        "precision", "N", "items/s", "vs fp32", "min cosine / token agreement", "note", title="precision"
    )
    for row in rows:
        table.add_row(
            row["precision"],
            _cell(row.get("max_batch_size")),
            _cell(row.get("items_per_s"), ",.0f"),
            _cell(row.get("speedup"), ".2f"),
            _cell(row.get("min_cosine", row.get("token_agreement")), ".5f"),
            row.get("note", ""),
        )
    console.print(table)


def check_output_dir(directory: Path) -> None:
    """Refuse, before anything is measured, a ``-o`` folder that cannot be written: it is created (as the
    outputs would create it) and a probe file is written there and removed."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as exc:
        raise TuneError(f"-o {directory}: cannot write there ({exc.strerror or exc})") from None


def write_outputs(directory: Path, points: Sequence[Point], result: Mapping[str, Any]) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    csv_path, json_path, png_path = directory / "points.csv", directory / "tune.json", directory / "curve.png"
    with csv_path.open("w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=CSV_FIELDS)
        writer.writeheader()
        writer.writerows(point_row(p) for p in sorted(points, key=lambda p: (p.precision, p.length, p.n)))
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    plot(png_path, points, result)
    return [csv_path, json_path, png_path]


def plot(path: Path, points: Sequence[Point], result: Mapping[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")  # headless: no display on a worker host
    import matplotlib.pyplot as plt

    mine = plotted(points, result)
    fig, (speed, latency) = plt.subplots(1, 2, figsize=(12, 4.8))
    knees = {int(k): v for k, v in result.get("knee", {}).items()}
    for length, curve in by_length(mine).items():
        sizes = [p.n for p in curve]
        line = speed.plot(sizes, [p.items_per_s for p in curve], marker=".", label=f"length {length}")[0]
        latency.plot(
            sizes, [p.p99_ms for p in curve], marker=".", color=line.get_color(), label=f"length {length}"
        )
        if length in knees:
            at = next(p for p in curve if p.n == knees[length])
            speed.plot([at.n], [at.items_per_s], "o", mfc="none", ms=11, color=line.get_color())
    for name, lane in result["lanes"].items():
        latency.axhline(lane["bound_ms"], ls="--", lw=0.8, color="grey")
        latency.annotate(f"{name} bound", (1, lane["bound_ms"]), fontsize=7, va="bottom")
        if lane["max_batch_size"]:
            for axis in (speed, latency):
                axis.axvline(lane["max_batch_size"], ls=":", lw=1, color="black")
            speed.annotate(
                f"{name} N={lane['max_batch_size']}",
                (lane["max_batch_size"], 0.02),
                xycoords=("data", "axes fraction"),
                fontsize=7,
                rotation=90,
                va="bottom",
            )
    speed.set(xscale="log", xlabel="batch size N", ylabel="items/s", title="throughput (o: knee)")
    latency.set(
        xscale="log",
        yscale="log",
        xlabel="batch size N",
        ylabel="p99 batch run time, ms",
        title="p99 batch time",
    )
    speed.legend(fontsize=8)
    fig.suptitle(_title(result))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plotted(points: Sequence[Point], result: Mapping[str, Any]) -> list[Point]:
    """The chosen precision's points (with --backends, the chosen pair's, labelled "backend/precision")."""
    series = f"{result['backend']}/{result['precision']}" if "backend" in result else result["precision"]
    return [p for p in points if p.precision == series and not p.oom]


def _title(result: Mapping[str, Any]) -> str:
    ran = f"{result['backend']} {result['precision']}" if "backend" in result else result["precision"]
    return f"{result['model']} on {result['device_kind']} ({ran}): --max-batch-ms {result['max_batch_ms']:g}"


def _marks(result: Mapping[str, Any]) -> dict[tuple[int, int], list[str]]:
    marks: dict[tuple[int, int], list[str]] = {}
    for length, n in result.get("knee", {}).items():
        marks.setdefault((int(length), n), []).append("knee")
    for name, lane in result["lanes"].items():
        for length, n in lane.get("per_length", {}).items():
            marks.setdefault((int(length), n), []).append(name)
    return marks


def _cell(value: Any, spec: str = "") -> str:
    return "-" if value is None else format(value, spec)
