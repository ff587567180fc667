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
    console.print(f"[red]error:[/red] {message}", highlight=False)
    return typer.Exit(2)


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
def api(
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port to listen on")] = 8000,
) -> None:
    """Serve the HTTP API and the jobs page (uvicorn) on the configured broker and database."""
    settings = get_settings()
    if settings.embedded:
        raise fail("no broker configured: set BATCHWORK_BROKER_URL (e.g. redis://localhost:6379/0)")
    import uvicorn

    from api.app import create_app

    # No access log: /metrics counts requests by route and status without a line per poll.
    uvicorn.run(create_app(settings), host=host, port=port, access_log=False, log_level="info")


keys_app = typer.Typer(no_args_is_help=True, help="API keys: create, list, revoke.")
app.add_typer(keys_app, name="keys")


class _key_store:
    """The KeyStore of BATCHWORK_DATABASE_URL; a database error ends the command in one line."""

    def __enter__(self) -> Any:
        from worker.store.keys import KeyStore
        from worker.tasks import job_store

        return KeyStore(job_store(get_settings().database_url).engine)

    def __exit__(self, kind: Any, exc: BaseException | None, _tb: Any) -> None:
        from sqlalchemy.exc import SQLAlchemyError

        if isinstance(exc, SQLAlchemyError):
            first_line = str(getattr(exc, "orig", None) or exc).splitlines()[0]
            raise fail(f"database: {first_line} (is it migrated? batchwork migrate)") from None


@keys_app.command("create")
def keys_create(
    tenant: Annotated[str, typer.Option(help="whose jobs the key submits and sees")],
    admin: Annotated[
        bool, typer.Option(help="also see the jobs submitted from Python (tenant 'default')")
    ] = False,
) -> None:
    """Make a key and print it once; only its hash is stored."""
    from worker.store.keys import InvalidTenant

    try:
        with _key_store() as keys:
            record, key = keys.create(tenant, admin=admin)
    except InvalidTenant as exc:
        raise fail(str(exc)) from None
    console.print(
        f"key {record.key_id} for tenant {tenant}{' (admin)' if admin else ''}; it is not shown again:"
    )
    print(key)


@keys_app.command("list")
def keys_list() -> None:
    """Every key's id, tenant, role and dates (never the key)."""
    table = Table("id", "tenant", "admin", "created", "revoked")
    with _key_store() as keys:
        found = keys.all()
    for key in found:
        revoked = f"{key.revoked_at:%Y-%m-%d %H:%M}" if key.revoked_at else ""
        table.add_row(
            key.key_id, key.tenant, "yes" if key.admin else "", f"{key.created_at:%Y-%m-%d %H:%M}", revoked
        )
    Console().print(table)


@keys_app.command("revoke")
def keys_revoke(key_id: Annotated[str, typer.Argument(help="the id from `batchwork keys list`")]) -> None:
    """Revoke a key: requests with it answer 401 from now on."""
    with _key_store() as keys:
        revoked = keys.revoke(key_id)
    if not revoked:
        raise fail(f"no live key {key_id} (see batchwork keys list)")
    console.print(f"revoked {key_id}")


@app.command()
def models() -> None:
    """The models this installation can serve."""
    from worker.models.registry import describe

    table = Table("name", "description", "N", "T ms")
    for name, text, size, wait_ms in describe():
        table.add_row(name, text, str(size), f"{wait_ms:g}")
    Console().print(table)


if __name__ == "__main__":
    app()
