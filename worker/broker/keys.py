"""Every Redis key batchwork uses, in one place, all under the queue prefix (``BATCHWORK_QUEUE``).

Two deployments that share a Redis database with different prefixes never see each other's keys.
"""

from __future__ import annotations

from dataclasses import dataclass

from worker.batching.policy import PRIORITIES
from worker.settings import Settings


@dataclass(frozen=True, slots=True)
class Keys:
    prefix: str = "batchwork"

    @classmethod
    def of(cls, settings: Settings) -> Keys:
        return cls(settings.queue)

    def queue(self, priority: str) -> str:
        """The list a priority's messages wait in (what Celery calls the queue)."""
        return f"{self.prefix}.{priority}"

    @property
    def queues(self) -> list[str]:
        """Every priority's queue, most urgent first."""
        return [self.queue(priority) for priority in PRIORITIES]

    @property
    def unacked(self) -> str:
        """Hash: delivery tag -> "queue\\nmessage" of every message a worker holds unacknowledged."""
        return f"{self.prefix}.unacked"

    @property
    def unacked_index(self) -> str:
        """Sorted set: delivery tag -> when its lease was last renewed (the restore sweep reads it)."""
        return f"{self.prefix}.unacked_index"

    @property
    def delivery_tags(self) -> str:
        """Counter that numbers deliveries, so a tag is unique however often a message is delivered."""
        return f"{self.prefix}.delivery_tags"

    @property
    def lost(self) -> str:
        """Hash: task id -> how often the worker holding that message vanished before acknowledging it."""
        return f"{self.prefix}.lost"

    @property
    def item_deaths(self) -> str:
        """Hash: "job:index" -> how often a worker died while running that item of a suspect message."""
        return f"{self.prefix}.item_deaths"

    @property
    def epoch(self) -> str:
        """A value every worker expects to find; gone means Redis restarted empty."""
        return f"{self.prefix}.broker_epoch"

    @property
    def pending_jobs(self) -> str:
        """Sorted set: job id -> when its producer wrote its ``job`` record (for the census of messages)."""
        return f"{self.prefix}.pending_jobs"

    @property
    def lost_suspects(self) -> str:
        """Hash: job id -> when a census first found none of its messages (cleared when one is found)."""
        return f"{self.prefix}.lost_suspects"

    @property
    def lost_census(self) -> str:
        """Lock: the worker that holds it runs the next census of messages (one for all workers a period)."""
        return f"{self.prefix}.lost_census"

    def job(self, job_id: str) -> str:
        """Hash: a job accepted by a producer that no worker has recorded in SQL yet."""
        return f"{self.prefix}.job:{job_id}"
