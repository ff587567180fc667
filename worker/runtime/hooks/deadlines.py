"""Deadlines: a job's items not started before its deadline (``expires_at``, wall-clock seconds) never run;
each ends with an error saying so. Decided per message, as the deadline is the job's; the engine calls this
hook only for messages whose job has a deadline.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from worker.runtime.deliveries import Pack
from worker.runtime.hooks import Hook, Run, Scope

EXPIRED = "expired: not started before the job's deadline"


class Deadlines(Hook):
    scope: Scope = "deadline"

    def before_batch(self, runs: Sequence[Run]) -> dict[Pack, str]:
        now: float | None = None
        dropped: dict[Pack, str] = {}
        for pack, _ in runs:
            call = pack.delivery.call
            if call is None or call.expires_at is None:
                continue
            if now is None:
                now = time.time()
            if now > call.expires_at:
                dropped[pack] = EXPIRED
        return dropped
