"""The ``batchwork`` command: run a file end to end, or drive workers and jobs one step at a time.

Every mistake and outage ends in one line and exit code 2, never a traceback: ``main`` turns batchwork's
own errors, bad settings and Ctrl-C into lines. User text is printed as text, never read as Rich markup.
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError
from pydantic_settings import SettingsError
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from worker.errors import BatchworkError, InvalidInput, SetupError, UsageError
from worker.jsonl import InputFileError, Inputs, check_output_path, output, read_inputs, write_results
from worker.settings import PRIORITIES, Settings, get_settings

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Celery-native batch inference.",
)
console = Console(stderr=True, highlight=False, emoji=False, soft_wrap=True)
out_console = Console(highlight=False, emoji=False, soft_wrap=True)

ModelOpt = Annotated[str, typer.Option("--model", "-m", help="model name or package.module:Class")]
PriorityOpt = Annotated[str, typer.Option("--priority", "-p", help=f"one of {', '.join(PRIORITIES)}")]
OutOpt = Annotated[Path | None, typer.Option("--output", "-o", help="results JSONL (default: stdout)")]


def main() -> None:
    """The entry point: the command, with every expected failure as one line."""
    try:
        get_settings()
        app()
    except (ValidationError, SettingsError) as exc:
        _fail_line(_settings_error(exc))
    except BatchworkError as exc:
        _fail_line(str(exc))
    except KeyboardInterrupt:
        console.print(Text("interrupted"))
        sys.exit(130)


def _fail_line(message: str) -> None:
    console.print(Text("error: ", style="red") + Text(message))
    sys.exit(2)


def _settings_error(exc: ValidationError | SettingsError) -> str:
    if isinstance(exc, SettingsError):  # a value that is not the JSON its setting takes
        field = re.search(r'field "(\w+)"', str(exc))
        name = f"BATCHWORK_{field.group(1).upper()}" if field else "a BATCHWORK_ setting"
        return f"bad setting {name}: not valid JSON ({exc.__cause__ or exc})"
    first = exc.errors()[0]
    name = "BATCHWORK_" + "__".join(str(part) for part in first["loc"]).upper()
    return f"bad setting {name}: {first['msg']} (got {str(first.get('input'))[:80]!r})"


def _client(settings: Settings | None = None) -> Any:
    from worker.client import Client

    return Client(settings or get_settings())


# -- the main job --------------------------------------------------------------------------------


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
    inputs = read_inputs(input_path, settings.max_items_per_job)
    client = _client(settings)
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
    client = _client(settings)
    print(client.enqueue(_checked(client, inputs, model, priority)))


@app.command()
def status(job_id: str) -> None:
    """A job's state and counts, its most common errors, and the batches that carried it."""
    client = _client()
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
    client = _client()
    client.status(job_id)
    check_output_path(output_path)
    with output(output_path) as out:
        write_results(out, client.results(job_id))


@app.command()
def cancel(job_id: str) -> None:
    """Mark a job cancelled."""
    changed = _client().cancel(job_id)
    console.print(Text("cancelled" if changed else "already finished"))


@app.command()
def worker(loglevel: str = "INFO", hostname: str | None = None) -> None:
    """Run a batching worker on the configured broker and database."""
    settings = get_settings()
    if settings.embedded:
        raise SetupError("no broker configured: set BATCHWORK_BROKER_URL (e.g. redis://localhost:6379/0)")
    store = _client(settings).store
    store.ensure_sqlite_schema()
    if not store.has_schema():
        raise SetupError(f"the database {store.location()} has no batchwork schema: run `batchwork migrate`")
    from worker.celery_app import app as celery_app

    argv = ["worker", f"--loglevel={loglevel}"]
    celery_app.worker_main(argv + ([f"--hostname={hostname}"] if hostname else []))


@app.command()
def migrate() -> None:
    """Create or upgrade the database schema (BATCHWORK_DATABASE_URL)."""
    from worker.store.db import client_errors, shown_url
    from worker.store.schema import migrate as run_migrations

    url = get_settings().database_url
    with client_errors(url):
        run_migrations(url)
    console.print(Text(f"{shown_url(url)} is at the latest schema"))


@app.command()
def api(
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port to listen on")] = 8000,
) -> None:
    """Serve the HTTP API and the jobs page (uvicorn) on the configured broker and database."""
    settings = get_settings()
    if settings.embedded:
        raise SetupError("no broker configured: set BATCHWORK_BROKER_URL (e.g. redis://localhost:6379/0)")
    import uvicorn

    from api.app import create_app

    # No access log: /metrics counts requests by route and status without a line per poll.
    uvicorn.run(create_app(settings), host=host, port=port, access_log=False, log_level="info")


keys_app = typer.Typer(no_args_is_help=True, help="API keys: create, list, revoke.")
app.add_typer(keys_app, name="keys")


@contextmanager
def _key_store() -> Iterator[Any]:
    """The KeyStore of BATCHWORK_DATABASE_URL; a database error ends the command in one line."""
    from worker.store.db import client_errors
    from worker.store.keys import KeyStore

    store = _client().store
    store.ensure_sqlite_schema()
    with client_errors(store.url):
        yield KeyStore(store.engine)


@keys_app.command("create")
def keys_create(
    tenant: Annotated[str, typer.Option(help="whose jobs the key submits and sees")],
    admin: Annotated[
        bool, typer.Option(help="also see the jobs submitted from Python (tenant 'default')")
    ] = False,
) -> None:
    """Make a key and print it once; only its hash is stored."""
    with _key_store() as keys:
        record, key = keys.create(tenant, admin=admin)
    console.print(
        Text(f"key {record.key_id} for tenant {tenant}{' (admin)' if admin else ''}; it is not shown again:")
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
        created = f"{key.created_at:%Y-%m-%d %H:%M}"
        table.add_row(key.key_id, Text(key.tenant), "yes" if key.admin else "", created, revoked)
    out_console.print(table)


@keys_app.command("revoke")
def keys_revoke(key_id: Annotated[str, typer.Argument(help="the id from `batchwork keys list`")]) -> None:
    """Revoke a key: requests with it answer 401 from now on."""
    with _key_store() as keys:
        revoked = keys.revoke(key_id)
    if not revoked:
        raise UsageError(f"no live key {key_id} (see batchwork keys list)")
    console.print(Text(f"revoked {key_id}"))


@app.command()
def models() -> None:
    """The models this deployment serves (BATCHWORK_MODELS), with their default N and T."""
    from worker.models.registry import served_models

    table = Table("name", "description", "N", "T ms")
    for row in served_models(get_settings()):
        if isinstance(row, BatchworkError):
            table.add_row("", Text(str(row), style="red"), "", "")
        else:
            table.add_row(
                Text(row.name), Text(row.description), str(row.max_batch_size), f"{row.max_wait_ms:g}"
            )
    out_console.print(table)


if __name__ == "__main__":
    main()
