"""``batchwork run batch.jsonl -o out.jsonl`` with no ``--model``, for OpenAI batch files: each line is
``{custom_id, method, url, body}`` and its body names its model. The file is checked whole first (a bad
line is one message naming it, and nothing runs); each model's requests become one job; the output is
OpenAI's batch output, one line per request in input order, and failed requests go to ``--errors`` (or,
without it, into the output among the others, as vLLM's run_batch writes them).
"""

from __future__ import annotations

import sys
import time
import uuid
from pathlib import Path
from typing import Any

import orjson
import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text

from worker.calls import NewJob, priority_of
from worker.cli.base import console, make_client
from worker.jsonl import BOM, InputFileError, check_output_path, output
from worker.openai_compat.batchfile import BatchPlan, StoredResults, answer_lines, plan_batch
from worker.openai_compat.tokens import count_tokens, detokenize
from worker.settings import Settings, get_settings

SHOWN_ERRORS = 10  # a refused file names at most this many of its bad lines


def is_openai_batch(path: Path) -> bool:
    """Is the file's first non-blank line an OpenAI batch request ({custom_id, url, body})?"""
    try:
        with path.open("rb") as handle:
            for raw in handle:
                if raw.strip():
                    line = orjson.loads(raw.removeprefix(BOM))
                    return isinstance(line, dict) and {"custom_id", "url", "body"} <= line.keys()
    except (OSError, orjson.JSONDecodeError):
        return False
    return False


def run_openai_batch(
    input_path: Path, output_path: Path | None, errors_path: Path | None, priority: str
) -> None:
    settings = get_settings()
    priority = priority_of(priority)  # the -m path checks it in new_job; this one makes its NewJob itself
    check_output_path(output_path)
    check_output_path(errors_path)
    if not is_openai_batch(input_path):
        raise InputFileError(
            f"{input_path}: give --model NAME (the file is not an OpenAI batch file, whose lines are "
            "{custom_id, method, url, body} and name their own model)"
        )
    lines = _read_lines(input_path)
    if settings.embedded:
        _serve_named_checkpoints(lines, settings)
    plan = plan_batch(lines, None, settings, detokenize)
    if plan.error_count:
        shown = "; ".join(f"line {e.line}: {e.message}" for e in plan.errors[:SHOWN_ERRORS])
        more = f" (and {plan.error_count - SHOWN_ERRORS} more)" if plan.error_count > SHOWN_ERRORS else ""
        raise InputFileError(f"{input_path}: {plan.error_count} bad line(s), nothing ran: {shown}{more}")
    client = make_client(settings)
    if not settings.embedded:
        _run(client, plan, priority, output_path, errors_path)
        return
    from worker.celery_app import app as celery_app
    from worker.runtime.embedded import embedded_worker

    client.store.ensure_sqlite_schema()
    console.print(Text(f"no broker configured: running an in-process worker on {client.store.location()}"))
    with embedded_worker(celery_app):
        _run(client, plan, priority, output_path, errors_path)


def _read_lines(path: Path) -> list[bytes]:
    try:
        return path.read_bytes().removeprefix(BOM).splitlines()
    except OSError as exc:
        raise InputFileError(f"{path}: {exc.strerror or exc}") from None


def _serve_named_checkpoints(lines: list[bytes], settings: Settings) -> None:
    """The embedded run serves ``KIND:/dir`` models named by the file's lines (its own process only), each
    directory checked first."""
    from worker.models.registry import check_checkpoints

    names: set[str] = set()
    for raw in lines:
        try:
            model = orjson.loads(raw).get("body", {}).get("model")
        except (orjson.JSONDecodeError, AttributeError):
            continue
        if isinstance(model, str):
            names.add(model)
    for name in sorted(names):
        settings.serve_checkpoint(name)
        check_checkpoints(settings, only=name)  # before any work, as for -m: one line, exit 2


def _run(
    client: Any, plan: BatchPlan, priority: str, output_path: Path | None, errors_path: Path | None
) -> None:
    started = time.monotonic()
    jobs = {}
    for model, items in plan.items.items():
        call = NewJob(str(uuid.uuid4()), model, items, priority, 0, len(items), None, time.time())
        jobs[model] = client.jobs.enqueue(call)
        console.print(Text(f"job {jobs[model]}: {len(items)} inputs on {model}"))
    try:
        _follow(client, jobs, sum(len(items) for items in plan.items.values()))
        missing = "no result was stored"
    except KeyboardInterrupt:
        for job_id in jobs.values():
            client.cancel(job_id)
        console.print(
            Text("interrupted: the jobs are cancelled; unfinished requests are written as cancelled")
        )
        missing = "cancelled"
    completed, failed = _write(client, plan, jobs, missing, output_path, errors_path)
    elapsed = time.monotonic() - started
    rate = len(plan.lines) / elapsed
    console.print(Text(f"{completed} requests completed, {failed} failed in {elapsed:.2f} s ({rate:,.0f}/s)"))
    if missing == "cancelled":
        sys.exit(130)
    if failed:
        raise typer.Exit(1)


def _follow(client: Any, jobs: dict[str, str], total: int) -> None:
    from worker.store.values import FINISHED_STATES

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        bar = progress.add_task("inputs", total=total)
        while True:
            statuses = [client.status(job_id) for job_id in jobs.values()]
            progress.update(bar, completed=sum(s.done + s.failed for s in statuses))
            if all(s.state in FINISHED_STATES for s in statuses):
                return
            time.sleep(0.2)


def _write(
    client: Any,
    plan: BatchPlan,
    jobs: dict[str, str],
    missing: str,
    output_path: Path | None,
    errors_path: Path | None,
) -> tuple[int, int]:
    from worker.models.registry import model_class

    settings = client.settings
    outcomes: dict[str, StoredResults] = {
        model: ((r.index, r.output, r.error) for r in client.store.results(job_id))
        for model, job_id in jobs.items()
    }

    def counter(model: str, texts: list[str]) -> list[int]:
        return count_tokens(model_class(model, settings), texts)

    batch_id = "run-" + uuid.uuid4().hex
    completed = failed = 0
    with output(output_path) as out:
        if errors_path is None:
            for answer in answer_lines(plan, outcomes, batch_id, missing, counter):
                out.write(answer.line)
                completed, failed = completed + answer.ok, failed + (not answer.ok)
            return completed, failed
        with output(errors_path) as errors:
            for answer in answer_lines(plan, outcomes, batch_id, missing, counter):
                (out if answer.ok else errors).write(answer.line)
                completed, failed = completed + answer.ok, failed + (not answer.ok)
    return completed, failed
