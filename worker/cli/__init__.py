"""The ``batchwork`` command: run a file end to end, or drive workers and jobs one step at a time.

Every mistake and outage ends in one line and exit code 2, never a traceback: ``main`` turns batchwork's own
errors, bad settings, usage mistakes (a bad flag or value) and Ctrl-C into lines. jobs.py holds the job
commands, operate.py the deployment's; base.py what they share.
"""

from __future__ import annotations

import re
import sys

from pydantic import ValidationError
from pydantic_settings import SettingsError
from rich.text import Text

from worker.cli import jobs, operate, purge  # noqa: F401  (their commands register on the app)
from worker.cli.base import app, console
from worker.errors import BatchworkError
from worker.settings import get_settings

__all__ = ["app", "main"]


def main() -> None:
    """The entry point: the command, with every expected failure as one line."""
    # Typer 0.29 carries its own copy of Click; its exceptions live here (typer is pinned).
    from typer._click.exceptions import NoArgsIsHelpError, UsageError

    try:
        get_settings()
        code = app(standalone_mode=False)
    except NoArgsIsHelpError as exc:
        print(exc.ctx.get_help() if exc.ctx else str(exc))
        code = 0
    except UsageError as exc:
        command = f"batchwork {exc.ctx.info_name}: " if exc.ctx and exc.ctx.parent else ""
        _fail_line(f"{command}{exc.format_message()}")
    except (ValidationError, SettingsError) as exc:
        _fail_line(_settings_error(exc))
    except BatchworkError as exc:
        _fail_line(str(exc))
    except KeyboardInterrupt:
        console.print(Text("interrupted"))
        code = 130
    sys.exit(code or 0)


def _fail_line(message: str) -> None:
    console.print(Text("error: ", style="red") + Text(message))
    sys.exit(2)


def _settings_error(exc: ValidationError | SettingsError) -> str:
    if isinstance(exc, SettingsError):  # a value that is not the JSON its setting takes
        field = re.search(r'field "(\w+)"', str(exc))
        name = f"BATCHWORK_{field.group(1).upper()}" if field else "a BATCHWORK_ setting"
        return f"bad setting {name}: not valid JSON ({exc.__cause__ or exc})"
    first = exc.errors()[0]
    setting, *path = [str(part) for part in first["loc"]]
    name = f"BATCHWORK_{setting.upper()}" + (f" ({'.'.join(path)})" if path else "")
    if first["type"] == "extra_forbidden":
        return f"bad setting {name}: unknown option"
    if first["type"] == "value_error":  # our own check's message, whole: it names what is wrong
        return f"bad setting {name}: {first['msg'].removeprefix('Value error, ')}"
    return f"bad setting {name}: {first['msg']} (got {str(first.get('input'))[:80]!r})"
