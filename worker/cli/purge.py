"""``batchwork purge``: end every unfinished job as cancelled, then empty the queues.

For an operator who wants a clean slate. Unlike ``celery purge``, which only drops messages (their jobs then
wait until the census ends them as lost), every job ends at once, with its waiting items stored as cancelled.
"""

from __future__ import annotations

import sys
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any

import typer
from rich.text import Text

from worker.cli.base import app, console, make_client
from worker.errors import UsageError
from worker.settings import Settings, get_settings

PURGED_ERROR = "cancelled: batchwork purge ended the job"


@app.command()
def purge(
    yes: Annotated[bool, typer.Option("--yes", "-y", "-f", help="do not ask for confirmation")] = False,
) -> None:
    """End every unfinished job as cancelled (waiting items stored as cancelled), then empty the queues."""
    from worker.store.db import client_errors
    from worker.store.values import JobSpec

    settings = get_settings()
    client = make_client(settings)
    store = client.store
    broker = None if settings.embedded else _Broker(settings)
    jobs = _unfinished(store)
    pending = broker.pending.all() if broker else {}
    where = store.location() + ("" if broker is None else f" and the queues of {broker.shown}")
    if not yes:
        _confirm(f"end {len(jobs) + len(pending)} unfinished jobs as cancelled and empty {where}?")
    with client_errors(store.url):
        for job in jobs:
            store.cancel(job.job_id)
            store.end_missing(job, PURGED_ERROR)
        if pending:
            store.ensure_sqlite_schema()
        for job_id, record in pending.items():
            client.jobs.cancel(job_id)  # known only to Redis: the port records it in SQL as cancelled
            job = JobSpec(job_id, record["model"], record["priority"], int(record["total"]))
            store.end_missing(job, PURGED_ERROR)
    broker_part = ""
    if broker is not None:
        broker.pending.forget(list(pending))
        broker_part = f"; {broker.empty_queues()} messages removed from the queues"
    console.print(Text(f"{len(jobs) + len(pending)} jobs cancelled{broker_part}"))


def _unfinished(store: Any) -> list[Any]:
    if not store.has_schema():
        return []
    from worker.store.db import client_errors

    with client_errors(store.url):
        return list(store.unfinished_jobs(created_before=datetime.now(UTC) + timedelta(days=1)))


def _confirm(question: str) -> None:
    if not sys.stdin.isatty():
        raise UsageError(f"purge would {question[:-1]}: pass --yes to confirm")
    if not typer.confirm(question.capitalize(), default=False):
        raise typer.Exit(1)


class _Broker:
    def __init__(self, settings: Settings) -> None:
        from worker.broker.keys import Keys
        from worker.broker.producer import PendingJobs, broker_redis
        from worker.store.db import shown_url

        self.url = settings.broker_url
        self.shown = shown_url(self.url)
        self.keys = Keys.of(settings)
        self.client = broker_redis(self.url)
        self.pending = PendingJobs(self.url, self.keys)

    def empty_queues(self) -> int:
        """Drop every queue's messages in one transaction; how many there were."""
        import redis

        from worker.broker.producer import broker_unavailable

        queues = self.keys.queues
        try:
            pipe = self.client.pipeline(transaction=True)
            for queue in queues:
                pipe.llen(queue)
            pipe.delete(*queues)
            *lengths, _ = pipe.execute()
        except redis.RedisError as exc:
            raise broker_unavailable(self.url, exc) from exc
        return sum(lengths)
