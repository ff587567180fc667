"""The census of messages: which unfinished jobs have no message left anywhere in Redis (their queue, the held
set; a worker's hands are the held set until it acknowledges what it stored), whatever removed them.

One worker a period takes the census (a lock with the period as its life), in one script (scripts.CENSUS).
It only says which jobs are lost; runtime/lost_items.py ends them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from worker.broker import scripts
from worker.broker.keys import Keys

# Pending (Redis-only) jobs one census looks at, oldest first; the rest wait for the next.
PENDING_PER_CENSUS = 1000


@dataclass(frozen=True)
class Lost:
    """Jobs a census found lost: recorded in SQL, and recorded only in Redis (with their records)."""

    sql: list[str]
    pending: dict[str, dict[str, str]]


class MessageCensus:
    def __init__(self, client: Any, keys: Keys, grace_s: float) -> None:
        self.client = client
        self.keys = keys
        self.grace_s = grace_s
        self._script = client.register_script(scripts.CENSUS)

    def take_turn(self, holder: str, period_s: float) -> bool:
        """True for the one worker that takes this period's census."""
        return bool(self.client.set(self.keys.lost_census, holder, nx=True, px=max(1, int(period_s * 1000))))

    def lost(self, sql_jobs: Sequence[tuple[str, str]]) -> Lost:
        """Of these unfinished jobs, ``(job id, priority)``, and the pending ones, those no census has seen a
        message of for at least the grace period. One script call, then one round trip for the lost pending
        jobs' records."""
        keys = [self.keys.unacked, self.keys.lost_suspects, self.keys.pending_jobs, *self.keys.queues]
        args = [self.grace_s, PENDING_PER_CENSUS, self.keys.queue("")]
        args += [field for job in sql_jobs for field in job]
        lost_sql, lost_pending = self._script(keys=keys, args=args)
        pending_ids = [_text(job_id) for job_id in lost_pending]
        pipe = self.client.pipeline(transaction=False)
        for job_id in pending_ids:
            pipe.hgetall(self.keys.job(job_id))
        records = pipe.execute() if pending_ids else []
        return Lost(
            [_text(job_id) for job_id in lost_sql],
            {
                job_id: {_text(k): _text(v) for k, v in record.items()}
                for job_id, record in zip(pending_ids, records, strict=True)
                if record
            },
        )

    def forget(self, job_ids: list[str]) -> None:
        """These jobs are ended in SQL: drop their suspicion and, for pending jobs, their Redis records."""
        if not job_ids:
            return
        pipe = self.client.pipeline(transaction=False)
        pipe.hdel(self.keys.lost_suspects, *job_ids)
        pipe.delete(*(self.keys.job(job_id) for job_id in job_ids))
        pipe.zrem(self.keys.pending_jobs, *job_ids)
        pipe.execute()


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
