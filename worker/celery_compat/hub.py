"""kombu's event loop (``kombu.asynchronous.Hub``), made to come back at once after a busy turn.

Private thing: ``Hub.fire_timers(min_delay=1, max_timers=10)``. The hub fires at most 10 due timers per turn
of its loop; when all 10 ran it polls for ``min_delay``, one whole second by default, and nothing lets a
transport change that default. Celery's loop (``Hub.create_loop``) reads ``hub.fire_timers`` as an
attribute once it starts, after the transport registered with the loop, so a transport replaces the
attribute there (contract: tests/unit/test_celery_compat.py).
"""

from __future__ import annotations

from functools import partial
from typing import Any


def poll_again_after(loop: Any, min_delay_s: float) -> None:
    """Make ``loop`` poll for at most ``min_delay_s`` after a turn that fired its whole share of timers.
    Safe to call again (a reconnect registers the transport again)."""
    if not isinstance(loop.fire_timers, partial):
        loop.fire_timers = partial(loop.fire_timers, min_delay=min_delay_s)
