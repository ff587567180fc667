"""What the routes work with, built once per app: settings, the client that submits and cancels, the
store's reads, the keys, and the broker's Redis for queue depth and health.

It holds no per-request state; every read that names a job is scoped to the caller's tenants.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import redis

from worker.batching.policy import PRIORITIES
from worker.broker.keys import Keys
from worker.broker.producer import broker_redis, broker_unavailable
from worker.client import Client
from worker.errors import SetupError
from worker.jobs import Jobs, RedisMessages
from worker.settings import Settings
from worker.store.api_keys import KeyStore
from worker.store.catalog import JobCatalog
from worker.store.results import ResultStore


@dataclass(frozen=True)
class Backend:
    settings: Settings
    client: Client
    catalog: JobCatalog
    keys: KeyStore
    broker: redis.Redis | None  # None when the broker is not Redis

    @classmethod
    def from_settings(cls, settings: Settings) -> Backend:
        client = Client(settings)
        engine = client.store.engine  # SQLite: created and migrated on first use, like a producer's
        broker = None if settings.embedded else broker_redis(settings.broker_url)
        return cls(settings, client, JobCatalog(engine), KeyStore(engine), broker)

    @property
    def jobs(self) -> Jobs:
        """The jobs port: every route that enqueues, reads or cancels a job goes through it."""
        return self.client.jobs

    @property
    def store(self) -> ResultStore:
        return self.client.store

    def queue_depth(self) -> dict[str, int]:
        """Messages waiting in the broker per lane (LLEN of each priority's queue), in one round trip."""
        if self.broker is None:
            return dict.fromkeys(PRIORITIES, 0)
        try:
            with self.broker.pipeline(transaction=False) as pipe:
                for priority in PRIORITIES:
                    pipe.llen(Keys.of(self.settings).queue(priority))
                lengths = pipe.execute()
        except redis.RedisError as exc:  # a submit then answers 503 with Retry-After
            raise broker_unavailable(self.settings.broker_url, exc) from exc
        return {priority: int(length) for priority, length in zip(PRIORITIES, lengths, strict=True)}

    def warm(self) -> None:
        """Import and connect what a submit publishes with (the producer's module, its Redis connection)
        before the first submit, which would pay for them otherwise; a broker that is away now is no error
        (health says so, and a submit answers 503)."""
        messages = self.jobs.messages
        if isinstance(messages, RedisMessages):
            _check(messages.publisher.client.ping)

    def health(self) -> dict[str, str]:
        """ "ok" or the error, for the broker and the database."""
        return {"broker": _check(self._ping_broker), "database": _check(self._ping_database)}

    def _ping_broker(self) -> None:
        if self.broker is not None:
            self.broker.ping()

    def _ping_database(self) -> None:
        if not self.store.has_schema():  # reachable, but every route would fail: say why
            raise SetupError(f"no batchwork schema in {self.store.location()}: run `batchwork migrate`")


def _check(probe: Callable[[], object]) -> str:
    try:
        probe()
    except Exception as exc:  # health reports any failure as a line, never raises
        return f"{type(exc).__name__}: {exc}".splitlines()[0]
    return "ok"
