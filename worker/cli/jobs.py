"""The job commands: ``run`` (the main job: submit a file, follow it, write every line), ``submit``,
``status``, ``results`` and ``cancel``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from worker.cli.base import ModelOpt, OutOpt, PriorityOpt, app, console, make_client, out_console
from worker.errors import InvalidInput
from worker.jsonl import InputFileError, Inputs, check_output_path, output, read_inputs, write_results
from worker.settings import get_settings


@app.command()
def run(
    input_path: Annotated[Path, typer.Argument(metavar="INPUT.jsonl")],
    model: ModelOpt,
    output_path: OutOpt = None,
    priority: PriorityOpt = "normal",
) -> None:
    """Submit a file, show progress, wait, and write every item's result in input order."""
    settings = get_settings()
    check_output_path(output_path)
    if settings.embedded:
        settings.serve_checkpoint(model)
    inputs = read_inputs(input_path, settings.max_items_per_job)
    client = make_client(settings)
    call = _checked(client, inputs, model, priority)
    if not settings.embedded:
        _run_and_write(client, call, inputs, output_path)
        return
    from worker.celery_app import app as celery_app
    from worker.runtime.embedded import embedded_worker

    client.store.ensure_sqlite_schema()
    console.print(Text(f"no broker configured: running an in-process worker on {client.store.location()}"))
    with embedded_worker(celery_app):
        _run_and_write(client, call, inputs, output_path)


def _checked(client: Any, inputs: Inputs, model: str, priority: str) -> Any:
    try:
        return client.check(model, inputs, priority)
    except InvalidInput as exc:
        if exc.index is None:
            raise
        raise InputFileError(f"{inputs.line_of(exc.index)}: {exc.detail}") from None


def _run_and_write(client: Any, call: Any, inputs: Inputs, output_path: Path | None) -> None:
    started = time.monotonic()
    job_id = client.enqueue(call)
    console.print(Text(f"job {job_id}: {call.total} items on {call.model}"))
    try:
        status = _follow(client, job_id, call.total)
    except KeyboardInterrupt:
        client.cancel(job_id)
        console.print(Text(f"interrupted: job {job_id} cancelled; unfinished items are written as cancelled"))
        _write(client, job_id, inputs, output_path)
        sys.exit(130)
    elapsed = time.monotonic() - started
    _write(client, job_id, inputs, output_path)
    console.print(
        Text(
            f"{status.state}: {status.done} done, {status.failed} failed in {elapsed:.2f} s "
            f"({call.total / elapsed:,.0f} items/s)"
        )
    )
    _print_errors(status, console)
    if status.state != "succeeded":
        raise typer.Exit(1)


def _follow(client: Any, job_id: str, total: int) -> Any:
    from worker.store.values import FINISHED_STATES

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        bar = progress.add_task("items", total=total)
        while True:
            status = client.status(job_id)
            progress.update(bar, completed=status.done + status.failed, description=status.state)
            if status.state in FINISHED_STATES:
                return status
            time.sleep(0.2)


def _write(client: Any, job_id: str, inputs: Inputs, output_path: Path | None) -> None:
    """One line per input, in order: its stored outcome, or an error saying why it has none."""
    from worker.calls import item_id
    from worker.client import ItemResult

    missing = "cancelled" if client.status(job_id).state == "cancelled" else "no result was stored"

    def every_line() -> Iterator[ItemResult]:
        stored = iter(client.results(job_id))
        upcoming = next(stored, None)
        for index, item in enumerate(inputs):
            if upcoming is not None and upcoming.index == index:
                yield upcoming
                upcoming = next(stored, None)
            else:
                yield ItemResult(index, None, missing, _id_or_none(item_id, index, item))

    with output(output_path) as out:
        write_results(out, every_line())


def _id_or_none(item_id: Any, index: int, item: object) -> str | None:
    try:
        return item_id(index, item)
    except InvalidInput:
        return None


def _print_errors(status: Any, target: Console) -> None:
    for error, count in status.errors:
        target.print(Text(f"  {count} × {error}"))


# -- one step at a time ---------------------------------------------------------------------------


@app.command()
def submit(
    input_path: Annotated[Path, typer.Argument(metavar="INPUT.jsonl")],
    model: ModelOpt,
    priority: PriorityOpt = "normal",
) -> None:
    """Submit a file to the configured broker and print the job id."""
    settings = get_settings()
    inputs = read_inputs(input_path, settings.max_items_per_job)
    client = make_client(settings)
    print(client.enqueue(_checked(client, inputs, model, priority)))


@app.command()
def status(job_id: str) -> None:
    """A job's state and counts, its most common errors, and the batches that carried it."""
    client = make_client()
    job = client.status(job_id)
    table = Table(show_header=False, box=None)
    for name in ("job_id", "model", "priority", "state", "total", "done", "failed", "error"):
        value = getattr(job, name)
        if value is not None:
            table.add_row(name, Text(str(value)))
    for name in ("created_at", "started_at", "finished_at"):
        if getattr(job, name) is not None:
            table.add_row(name, str(getattr(job, name)))
    if job.generated_tokens is not None:
        table.add_row("generated_tokens", f"{job.generated_tokens} ({job.running_tokens} by running items)")
    out_console.print(table)
    if job.errors:
        out_console.print(Text("most common errors:"))
        _print_errors(job, out_console)
    _print_batches(client.store.recent_batches(job_id, limit=10))


def _print_batches(batches: list[Any]) -> None:
    if not batches:
        return
    recent = Table(
        "started",
        "lane",
        "size",
        "tokens real/padded",
        "oldest wait ms",
        "run ms",
        "worker",
        title="recent batches",
    )
    for b in batches:
        recent.add_row(
            f"{b.started_at:%H:%M:%S.%f}"[:-3],
            b.lane,
            str(b.size),
            f"{b.real_tokens}/{b.padded_tokens}",
            f"{b.wait_ms:.1f}",
            f"{b.run_ms:.1f}",
            Text(b.worker),
        )
    out_console.print(recent)


@app.command()
def results(job_id: str, output_path: OutOpt = None) -> None:
    """Write a job's stored results as JSONL, in index order (a file is replaced only once complete)."""
    client = make_client()
    client.status(job_id)
    check_output_path(output_path)
    with output(output_path) as out:
        write_results(out, client.results(job_id))


@app.command()
def cancel(job_id: str) -> None:
    """Mark a job cancelled."""
    changed = make_client().cancel(job_id)
    console.print(Text("cancelled" if changed else "already finished"))
