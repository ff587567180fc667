"""What every ``batchwork`` command shares: the Typer app, the consoles, the common options.

User text is printed as text, never read as Rich markup or emoji; lines are never wrapped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from worker.batching.policy import PRIORITIES
from worker.settings import Settings, get_settings

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Celery-native batch inference.",
)
console = Console(stderr=True, highlight=False, emoji=False, soft_wrap=True)
out_console = Console(highlight=False, emoji=False, soft_wrap=True)

ModelOpt = Annotated[
    str,
    typer.Option(
        "--model", "-m", help="model name, package.module:Class, or KIND:/dir (embed, classify, generate)"
    ),
]
PriorityOpt = Annotated[str, typer.Option("--priority", "-p", help=f"one of {', '.join(PRIORITIES)}")]
OutOpt = Annotated[Path | None, typer.Option("--output", "-o", help="results JSONL (default: stdout)")]


def make_client(settings: Settings | None = None) -> Any:
    from worker.client import Client

    return Client(settings or get_settings())
