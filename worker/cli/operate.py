"""The commands that run and look after a deployment: ``worker``, ``api``, ``migrate``, ``keys``, ``models``
and ``tune``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from worker.cli.base import app, console, make_client, out_console
from worker.errors import SetupError, UsageError
from worker.settings import get_settings

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


@app.command()
def worker(
    loglevel: str = "INFO",
    hostname: Annotated[
        str | None, typer.Option(help="this worker's name, e.g. gpu0@host-a (Flower shows it)")
    ] = None,
    queues: Annotated[
        str | None,
        typer.Option("--queues", "-Q", help="only these queues, e.g. batchwork.high (default: all three)"),
    ] = None,
) -> None:
    """Run a batching worker on the configured broker and database."""
    settings = get_settings()
    if settings.embedded:
        raise SetupError("no broker configured: set BATCHWORK_BROKER_URL (e.g. redis://localhost:6379/0)")
    from worker.models.registry import check_checkpoints

    check_checkpoints(settings)  # a bad checkpoint directory is one line at start, not a failure per message
    store = make_client(settings).store
    store.ensure_sqlite_schema()
    if not store.has_schema():
        raise SetupError(f"the database {store.location()} has no batchwork schema: run `batchwork migrate`")
    from worker.broker.keys import Keys
    from worker.celery_app import app as celery_app

    if loglevel.upper() not in LOG_LEVELS:
        raise UsageError(f"unknown log level {loglevel!r}: use one of {', '.join(LOG_LEVELS)}")
    known = Keys.of(settings).queues
    chosen = [name.strip() for name in (queues or "").split(",") if name.strip()]
    unknown = [name for name in chosen if name not in known]
    if unknown or (queues is not None and not chosen):
        shown = repr(unknown[0]) if unknown else "(none named)"
        raise UsageError(f"unknown queue {shown}: batchwork's queues are {', '.join(known)}")
    from worker.models.device import resolve_device

    resolve_device(settings.device)  # a device this machine lacks is one line before Celery starts
    argv = ["worker", f"--loglevel={loglevel.upper()}"]
    argv += [f"--hostname={hostname}"] if hostname else []
    argv += [f"--queues={','.join(chosen)}"] if chosen else []
    # Not worker_main: it drops the worker's exit code, and a worker that could not start exited 0.
    code = celery_app.start(argv=argv)
    if code:
        raise typer.Exit(code)


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
    port: Annotated[int, typer.Option(help="port to listen on", min=1, max=65535)] = 8000,
) -> None:
    """Serve the HTTP API and the jobs page (uvicorn) on the configured broker and database."""
    settings = get_settings()
    if settings.embedded:
        raise SetupError("no broker configured: set BATCHWORK_BROKER_URL (e.g. redis://localhost:6379/0)")
    import uvicorn

    from api.app import create_app

    # The socket is bound here, before anything starts, so a port in use (or an address this host lacks) is
    # one line and exit 2 rather than uvicorn's log after the app and its checking processes started.
    listening = _listening_socket(host, port)
    # No access log: /metrics counts requests by route and status without a line per poll.
    config = uvicorn.Config(create_app(settings), access_log=False, log_level="info")
    server = _announcing_server(config, f"http://{host}:{port}")
    server.run(sockets=[listening])
    if not server.started:  # the app's startup failed (uvicorn logged why)
        raise typer.Exit(1)


def _announcing_server(config: Any, url: str) -> Any:
    """uvicorn's server, which says where it listens once it does: uvicorn itself stays silent about sockets
    passed in (it expects its own multi-process supervisor to have said so), and benches wait for the line."""
    import logging

    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets=sockets)
            if self.started:
                logging.getLogger("uvicorn.error").info("Uvicorn running on %s (Press CTRL+C to quit)", url)

    return Server(config)


def _listening_socket(host: str, port: int) -> Any:
    import socket

    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        listening = socket.socket(family, socket.SOCK_STREAM)
        listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listening.bind((host, port))
    except OSError as exc:
        raise SetupError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    listening.set_inheritable(True)
    return listening


keys_app = typer.Typer(no_args_is_help=True, help="API keys: create, list, revoke.")
app.add_typer(keys_app, name="keys")


@contextmanager
def _key_store() -> Iterator[Any]:
    """The KeyStore of BATCHWORK_DATABASE_URL; a database error ends the command in one line."""
    from worker.store.api_keys import KeyStore
    from worker.store.db import client_errors

    store = make_client().store
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
    """The models this deployment serves (BATCHWORK_MODELS), with their effective N, T and token budget and
    where each comes from (setting > tuned > default) on this worker's device kind."""
    from worker.tuning.show import models_table

    # Piped or redirected, the table is printed whole rather than cut to 80 columns (kind and checkpoint
    # columns made it wider than that): what reads it gets every value.
    shown = out_console if out_console.is_terminal else Console(highlight=False, emoji=False, width=320)
    for part in models_table(get_settings()):
        shown.print(part)


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
    backends: Annotated[
        str | None, typer.Option("--backends", help="embed/classify: e.g. torch,onnx (each x --precisions)")
    ] = None,
    min_cosine: Annotated[
        float, typer.Option("--min-cosine", help="--apply with --backends: least cosine to torch fp32")
    ] = 0.9999,
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

    run_command(
        model,
        max_batch_ms=max_batch_ms,
        memory_fraction=memory_fraction,
        lengths=lengths,
        sample=sample,
        precisions=precisions,
        apply=apply,
        backends=backends,
        min_cosine=min_cosine,
        from_history=from_history,
        as_json=as_json,
        output_dir=output_dir,
        max_n=max_n,
        point_s=point_s,
        console=console,
    )
