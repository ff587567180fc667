"""The job commands: ``run`` (the main job: submit a file, follow it, write every line), ``submit``,
``status``, ``results`` and ``cancel``.
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from worker.cli.base import ModelOpt, OutOpt, PriorityOpt, app, console, make_client, out_console
from worker.cli.running import Interrupts, JobRun, RunState, check_file, fingerprint
from worker.errors import InvalidInput, JobNotFound, UsageError
from worker.jsonl import (
    InputFileError,
    Inputs,
    ResultFile,
    check_output_path,
    output,
    read_inputs,
    write_results,
)
from worker.settings import get_settings

OptionalModelOpt = Annotated[
    str | None,
    typer.Option(
        "--model",
        "-m",
        help="model name, package.module:Class, or KIND:/dir; none: an OpenAI batch file (lines name theirs)",
    ),
]
ErrorsOpt = Annotated[
    Path | None,
    typer.Option("--errors", help="OpenAI batch files: failed requests go here (default: the output)"),
]


@app.command()
def run(
    input_path: Annotated[Path, typer.Argument(metavar="INPUT.jsonl")],
    model: OptionalModelOpt = None,
    output_path: OutOpt = None,
    priority: PriorityOpt = "normal",
    errors_path: ErrorsOpt = None,
    restart: Annotated[
        bool, typer.Option("--restart", help="start over, rather than continue a killed run of this file")
    ] = False,
) -> None:
    """Submit a file, show progress, and write every item's result in input order as results arrive.

    Started again with the same arguments after it was killed, it continues the same job. Without --model,
    an OpenAI batch file ({custom_id, method, url, body} lines) in, OpenAI batch output out.
    """
    if model is None:
        from worker.cli.openai_run import run_openai_batch

        run_openai_batch(input_path, output_path, errors_path, priority)
        return
    settings = get_settings()
    if output_path is not None and str(output_path) == "-":
        output_path = None
    check_output_path(output_path)
    if settings.embedded:
        from worker.models.registry import check_checkpoints

        settings.serve_checkpoint(model)
        check_checkpoints(settings, only=model)  # before any work: a bad checkpoint directory is one line
    client = make_client(settings)
    call = check_file(client, input_path, model, priority, settings.max_items_per_job)
    state = None
    if output_path is not None:
        key = fingerprint(input_path, call.model, call.priority, settings.database_url)
        state = RunState.beside(output_path, key)
    run = _Run(client, call, input_path, ResultFile(output_path), state)
    if not settings.embedded:
        run.start(restart, embedded=False)
        return
    from worker.celery_app import app as celery_app
    from worker.runtime.embedded import embedded_worker

    client.store.ensure_sqlite_schema()
    console.print(Text(f"no broker configured: running an in-process worker on {client.store.location()}"))
    with embedded_worker(celery_app):
        run.start(restart, embedded=True)


class _Run:
    """The ``run`` command once its file passed: a new job, or the one a killed run of it left."""

    def __init__(self, client: Any, call: Any, path: Path, out: ResultFile, state: RunState | None) -> None:
        self.client, self.call, self.path, self.out, self.state = client, call, path, out, state
        self.interrupts = Interrupts()

    def start(self, restart: bool, embedded: bool) -> None:
        self.interrupts.install()
        previous = None if self.state is None else self.state.previous()
        if restart and previous is not None:
            self._drop(previous.job_id)
            previous = None
        if previous is not None and self._resumable(previous.job_id):
            self.call = replace(self.call, job_id=previous.job_id)
            written = self.out.open(resume=True)
            console.print(
                Text(f"continuing job {previous.job_id}: {written} lines written, {previous.published} sent")
            )
        else:
            previous = None
            metadata = None if self.state is None else {"run": self.state.fingerprint}
            self.client.jobs.record(self.call, metadata=metadata)
            written = self.out.open(resume=False)
        if self.state is not None:
            self.state.job_id, self.state.published = self.call.job_id, written
            self.state.save()
            self.interrupts.on_exit += [self.out.discard, self.state.remove]
        job = JobRun(self.client, self.call, self.path, self.out, self.state, self.interrupts)
        if previous is not None:
            job.resume_from(written, previous.published, embedded)
        self._follow(job, self.call.total - written)

    def _drop(self, job_id: str) -> None:
        """--restart: the killed run's job is cancelled, not left unfinished (its messages still queued)."""
        try:
            if self.client.cancel(job_id):
                console.print(Text(f"cancelled job {job_id} of the earlier run"))
        except JobNotFound:
            pass

    def _resumable(self, job_id: str) -> bool:
        from worker.store.values import JobState  # lazily: the store's package loads SQLAlchemy

        try:
            status = self.client.status(job_id)
        except JobNotFound:
            return False
        return status.total == self.call.total and status.state not in (JobState.CANCELLED, JobState.FAILED)

    def _follow(self, job: JobRun, items: int) -> None:
        """Run the job to its end; ``items``: how many lines this run writes (fewer when it continues)."""
        from worker.store.values import JobState

        started = time.monotonic()
        console.print(Text(f"job {self.call.job_id}: {self.call.total} items on {self.call.model}"))
        status = job.run()
        self.out.finish()
        if self.state is not None:
            self.state.remove()
        elapsed = time.monotonic() - started
        if self.interrupts.count:
            console.print(Text(f"cancelled: {status.done} done, {status.failed} failed or cancelled"))
            sys.exit(130)
        console.print(
            Text(
                f"{status.state}: {status.done} done, {status.failed} failed in {elapsed:.2f} s "
                f"({items / elapsed:,.0f} items/s)"
            )
        )
        _print_errors(status, console)
        if status.state != JobState.SUCCEEDED:
            raise typer.Exit(1)


def _checked(client: Any, inputs: Inputs, model: str, priority: str) -> Any:
    try:
        return client.check(model, inputs, priority)
    except InvalidInput as exc:
        if exc.index is None:
            raise
        raise InputFileError(f"{inputs.line_of(exc.index)}: {exc.detail}") from None


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
    print(client.jobs.enqueue(_checked(client, inputs, model, priority)))


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
def results(
    job_id: str,
    output_path: OutOpt = None,
    partial: Annotated[
        bool, typer.Option("--partial", help="write what is stored of an unfinished job")
    ] = False,
) -> None:
    """Write a finished job's stored results as JSONL, in index order (a file is replaced only once
    complete); an unfinished job's only with --partial."""
    from worker.store.values import FINISHED_STATES

    client = make_client()
    status = client.status(job_id)
    if status.state not in FINISHED_STATES and not partial:
        raise UsageError(
            f"job {job_id} is unfinished ({status.state}, {status.done + status.failed} of {status.total} "
            "items stored): nothing written; wait for it, or pass --partial to write what is stored"
        )
    check_output_path(output_path)
    with output(output_path) as out:
        write_results(out, client.results(job_id))


@app.command()
def cancel(job_id: str) -> None:
    """Mark a job cancelled."""
    changed = make_client().cancel(job_id)
    console.print(Text("cancelled" if changed else "already finished"))
