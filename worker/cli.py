"""The ``batchwork`` command: run a file end to end, or drive workers and jobs one step at a time.

User mistakes end in a one-line message and exit code 2, never a traceback.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from worker.jsonl import InputFileError, read_inputs, write_results
from worker.models.base import InvalidInput
from worker.settings import PRIORITIES, get_settings

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Celery-native batch inference.")
console = Console(stderr=True)

ModelOpt = Annotated[str, typer.Option("--model", "-m", help="model name or package.module:Class")]
PriorityOpt = Annotated[str, typer.Option("--priority", "-p", help=f"one of {', '.join(PRIORITIES)}")]
OutOpt = Annotated[Path | None, typer.Option("--output", "-o", help="results JSONL (default: stdout)")]


def fail(message: str) -> typer.Exit:
    console.print(f"[red]error:[/red] {message}", highlight=False, soft_wrap=True)
    return typer.Exit(2)


@app.callback()
def _check_settings() -> None:
    """Every command starts from valid settings: a bad BATCHWORK_ variable is one line, not a traceback."""
    from pydantic import ValidationError

    try:
        get_settings()
    except ValidationError as exc:
        raise fail(settings_error(exc)) from None


def settings_error(exc: Any) -> str:
    """The first problem of a settings ValidationError, named by its environment variable."""
    error = exc.errors()[0]
    name, *path = [str(part) for part in error["loc"]]
    where = f"BATCHWORK_{name.upper()}" + (f": {'.'.join(path)}" if path else "")
    if error["type"] == "extra_forbidden":
        return f"{where}: unknown option"
    return f"{where}: {error['msg']} (got {error['input']!r})"


def _client() -> Any:
    from worker.client import Client

    return Client()


def _submit(input_path: Path, model: str, priority: str) -> tuple[str, int]:
    settings = get_settings()
    try:
        inputs = read_inputs(input_path, model, settings)
        return _client().submit(model, inputs, priority), len(inputs)
    except (InputFileError, InvalidInput) as exc:
        raise fail(str(exc)) from None


@app.command()
def run(
    input_path: Annotated[Path, typer.Argument(metavar="INPUT.jsonl")],
    model: ModelOpt,
    output: OutOpt = None,
    priority: PriorityOpt = "normal",
) -> None:
    """Submit a file, show progress, wait, and write every item's result in input order."""
    settings = get_settings()
    try:
        read_inputs(input_path, model, settings)  # refuse a bad file before starting anything
    except (InputFileError, InvalidInput) as exc:
        raise fail(str(exc)) from None
    if settings.embedded:
        from worker.celery_app import app as celery_app
        from worker.runtime.embedded import embedded_worker
        from worker.tasks import job_store

        job_store(settings.database_url)  # creates and migrates the SQLite file
        console.print(f"no broker configured: running an in-process worker on {settings.database_url}")
        with embedded_worker(celery_app):
            _run_and_write(input_path, model, priority, output)
    else:
        _run_and_write(input_path, model, priority, output)


def _run_and_write(input_path: Path, model: str, priority: str, output: Path | None) -> None:
    started = time.monotonic()
    job_id, total = _submit(input_path, model, priority)
    console.print(f"job {job_id}: {total} items on {model}")
    status = _follow(job_id, total)
    elapsed = time.monotonic() - started
    client = _client()
    with _open_output(output) as out:
        write_results(out, client.results(job_id))
    console.print(
        f"{status.state}: {status.done} done, {status.failed} failed in {elapsed:.2f} s "
        f"({total / elapsed:,.0f} items/s)"
    )
    if status.state != "succeeded":
        raise typer.Exit(1)


def _follow(job_id: str, total: int) -> Any:
    from worker.client import FINISHED

    client = _client()
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        bar = progress.add_task("items", total=total)
        while True:
            status = client.status(job_id)
            progress.update(bar, completed=status.done + status.failed, description=status.state)
            if status.state in FINISHED:
                return status
            time.sleep(0.2)


class _open_output:
    def __init__(self, path: Path | None) -> None:
        self.path = path

    def __enter__(self) -> Any:
        self.file = self.path.open("wb") if self.path else sys.stdout.buffer
        return self.file

    def __exit__(self, *exc: object) -> None:
        if self.path:
            self.file.close()
        else:
            self.file.flush()


@app.command()
def submit(
    input_path: Annotated[Path, typer.Argument(metavar="INPUT.jsonl")],
    model: ModelOpt,
    priority: PriorityOpt = "normal",
) -> None:
    """Submit a file to the configured broker and print the job id."""
    job_id, _ = _submit(input_path, model, priority)
    print(job_id)


@app.command()
def status(job_id: str) -> None:
    """A job's state and counts, and the batches that carried it."""
    from worker.client import JobNotFound

    client = _client()
    try:
        job = client.status(job_id)
    except JobNotFound as exc:
        raise fail(str(exc)) from None
    table = Table(show_header=False, box=None)
    for name in (
        "job_id",
        "model",
        "priority",
        "state",
        "total",
        "done",
        "failed",
        "error",
        "created_at",
        "started_at",
        "finished_at",
    ):
        value = getattr(job, name)
        if value is not None:
            table.add_row(name, str(value))
    if job.generated_tokens is not None:
        table.add_row("generated_tokens", f"{job.generated_tokens} ({job.running_tokens} by running items)")
    Console().print(table)
    batches = client.store.recent_batches(job_id, limit=10)
    if batches:
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
                b.worker,
            )
        Console().print(recent)


@app.command()
def results(job_id: str, output: OutOpt = None) -> None:
    """Write a job's stored results as JSONL, in index order."""
    from worker.client import JobNotFound

    try:
        with _open_output(output) as out:
            write_results(out, _client().results(job_id))
    except JobNotFound as exc:
        raise fail(str(exc)) from None


@app.command()
def cancel(job_id: str) -> None:
    """Mark a job cancelled."""
    from worker.client import JobNotFound

    try:
        changed = _client().cancel(job_id)
    except JobNotFound as exc:
        raise fail(str(exc)) from None
    console.print("cancelled" if changed else "already finished")


@app.command()
def worker(loglevel: str = "INFO", hostname: str | None = None) -> None:
    """Run a batching worker on the configured broker and database."""
    settings = get_settings()
    if settings.embedded:
        raise fail("no broker configured: set BATCHWORK_BROKER_URL (e.g. redis://localhost:6379/0)")
    from worker.celery_app import app as celery_app

    argv = ["worker", f"--loglevel={loglevel}"]
    celery_app.worker_main(argv + ([f"--hostname={hostname}"] if hostname else []))


@app.command()
def migrate() -> None:
    """Create or upgrade the database schema (BATCHWORK_DATABASE_URL)."""
    from worker.store.schema import migrate as run_migrations

    run_migrations(get_settings().database_url)
    console.print("database is at the latest schema")


@app.command()
def models() -> None:
    """The models this installation can serve, with their effective N, T and token budget and the source of
    each (setting > tuned > default) on this worker's device kind."""
    from worker.tuning.show import models_table

    Console().print(*models_table(get_settings()))


@app.command()
def tune(
    model: Annotated[str, typer.Argument(help="model name or package.module:Class")],
    max_batch_ms: Annotated[
        float, typer.Option("--max-batch-ms", help="p99 bound on one batch's run time (normal lane)")
    ] = 200.0,
    memory_fraction: Annotated[
        float, typer.Option("--memory-fraction", help="share of the device's free memory a batch may use")
    ] = 0.9,
    lengths: Annotated[
        str, typer.Option("--lengths", help="'auto' or token lengths, e.g. 16,64,256")
    ] = "auto",
    sample: Annotated[
        Path | None, typer.Option("--sample", help="INPUT.jsonl: lengths and precision checks")
    ] = None,
    precisions: Annotated[str | None, typer.Option("--precisions", help="e.g. fp32,bf16,int8")] = None,
    apply: Annotated[bool, typer.Option("--apply", help="store the choice for every worker")] = False,
    from_history: Annotated[
        bool, typer.Option("--from-history", help="fit stored batches instead of sweeping")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
    output_dir: Annotated[
        Path | None, typer.Option("--output-dir", "-o", help="CSV, JSON and PNG here")
    ] = None,
    max_n: Annotated[int, typer.Option("--max-n", help="largest batch size to try")] = 1024,
    point_s: Annotated[float, typer.Option("--point-s", help="seconds of runs per point")] = 1.0,
) -> None:
    """Measure the batch curve on this device and choose N, T and the token budget per lane."""
    from worker.tuning.command import run_command
    from worker.tuning.request import TuneError

    try:
        run_command(
            model,
            max_batch_ms=max_batch_ms,
            memory_fraction=memory_fraction,
            lengths=lengths,
            sample=sample,
            precisions=precisions,
            apply=apply,
            from_history=from_history,
            as_json=as_json,
            output_dir=output_dir,
            max_n=max_n,
            point_s=point_s,
            console=console,
        )
    except TuneError as exc:
        raise fail(str(exc)) from None


def main() -> None:
    """The ``batchwork`` entry point: Typer's app, with a usage mistake (a bad flag or value) shown as one
    line and exit code 2 rather than Click's usage block."""
    # Typer 0.29 carries its own copy of Click; its exceptions live here (typer is pinned).
    from typer._click.exceptions import NoArgsIsHelpError, UsageError

    try:
        code = app(standalone_mode=False)
    except NoArgsIsHelpError as exc:
        print(exc.ctx.get_help() if exc.ctx else str(exc))
        code = 0
    except UsageError as exc:
        command = f"batchwork {exc.ctx.info_name}: " if exc.ctx and exc.ctx.parent else ""
        raise SystemExit(fail(f"{command}{exc.format_message()}").exit_code) from None
    except typer.Abort:
        code = 130
    raise SystemExit(code or 0)


if __name__ == "__main__":
    main()
