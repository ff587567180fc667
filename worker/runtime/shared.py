"""What the prepare and the run thread both work with, built once by the engine: the settings, the loaded
models, the scheduler and the condition that guards it, the store thread's queue, the outbox, the holdings,
the journal of suspects and the clock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from worker.batching.scheduler import Scheduler
from worker.runtime.deliveries import Holdings
from worker.runtime.journal import Journal
from worker.runtime.loaded_models import LoadedModels
from worker.runtime.outbox import Outbox
from worker.runtime.store_thread import Storer
from worker.settings import Settings


@dataclass(frozen=True)
class Shared:
    settings: Settings
    models: LoadedModels
    scheduler: Scheduler
    ready: threading.Condition  # guards the scheduler; notified when items arrive or limits change
    storer: Storer
    outbox: Outbox
    holdings: Holdings
    journal: Journal | None
    clock: Callable[[], float]
