"""The batching engine inside one worker: deliveries in, stored outcomes and acks out.

Four threads, one way: the *prepare* thread (prepare_thread.py) decodes messages, checks and tokenizes
their items and queues them in the scheduler; the *run* thread (run_thread.py) takes the next batch when
the model is free and runs it (or admits items and runs one step); the *store* thread (store_thread.py)
commits each group of batches in one transaction and only then hands complete messages to the outbox, whose
acks the consumer's thread sends; the *watch* thread (hooks/cancellation.py) keeps the set of cancelled jobs
fresh. The model never waits for receiving, tokenizing, storing or the database. What concerns every stage
(cancellation, deadlines, the journal of suspect items, task events, metrics) is a hook each (hooks/),
called by the threads at fixed points. This module only wires them.
"""

from __future__ import annotations

import gc
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable

from worker.batching.scheduler import Scheduler
from worker.broker.census import MessageCensus
from worker.models.device import device_kind
from worker.runtime.deliveries import Delivery, Holdings, Message
from worker.runtime.hooks import Hook, Hooks, metrics
from worker.runtime.hooks.cancellation import Cancellation
from worker.runtime.hooks.deadlines import Deadlines
from worker.runtime.hooks.journal import Journal, PoisonItems
from worker.runtime.hooks.metrics import Metrics
from worker.runtime.hooks.task_events import TaskEvents
from worker.runtime.loaded_models import LoadedModels
from worker.runtime.lost_items import LostItems
from worker.runtime.outbox import Outbox
from worker.runtime.prepare_thread import Preparer
from worker.runtime.run_thread import Runner
from worker.runtime.store_thread import Storer
from worker.runtime.tuned_watch import TunedLimitsWatcher
from worker.settings import Settings
from worker.store.ports import TunedStore, WorkerStore

log = logging.getLogger(__name__)

# At shutdown, a store that has failed every write this long gives up: its messages go to another worker.
STOP_STALLED_S = 5.0


class Engine:
    def __init__(
        self,
        settings: Settings,
        store: WorkerStore,
        outbox: Outbox,
        *,
        tuned_limits: TunedStore,
        device: str = "cpu",
        worker_name: str = "batchwork",
        journal: Journal | None = None,
        census: MessageCensus | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.device = device
        self.clock = clock
        self.holdings = Holdings()
        self.tuned = TunedLimitsWatcher(
            tuned_limits,
            device_kind(device),
            settings.tuned_refresh_s,
            worker_name,
            self._retune,
        )
        self.models = LoadedModels(settings, device, self.tuned.limits)
        self.scheduler = Scheduler(self.models.policy_for)
        self.cancels = Cancellation(store, self.holdings)
        # In this order: a message dropped (cancelled, expired) is neither journaled nor reported started.
        hooks: list[Hook] = [self.cancels, Deadlines()]
        if journal is not None:
            hooks.append(PoisonItems(journal, settings.max_deliveries))
        hooks += [TaskEvents(outbox), Metrics()]
        self.hooks = Hooks(hooks)
        self.storer = Storer(store, outbox, self.holdings, self.hooks)
        self.lost = LostItems(store, census)
        self.worker_name = worker_name
        self._ready = threading.Condition()  # guards the scheduler
        self.preparer = Preparer(
            settings,
            self.models,
            self.scheduler,
            self._ready,
            self.storer,
            self.holdings,
            self.hooks,
            clock,
        )
        self.runner = Runner(
            settings,
            self.models,
            self.scheduler,
            self._ready,
            self.storer,
            self.hooks,
            clock,
            worker_name,
            self.tuned.record_out_of_memory,
        )
        self.ready = threading.Event()
        self._stopping = self._dead_told = False
        self._threads = {
            "prepare": threading.Thread(target=self.preparer.loop, name="batchwork-prepare", daemon=True),
            "run": threading.Thread(target=self.runner.loop, name="batchwork-run", daemon=True),
            "store": threading.Thread(target=self.storer.loop, name="batchwork-store", daemon=True),
            "watch": threading.Thread(target=self.cancels.loop, name="batchwork-watch", daemon=True),
        }

    def start(self, preload: Iterable[str] = ()) -> None:
        self.tuned.start()  # before the first lane forms: a fresh worker starts with the tuned limits
        for name in preload:
            self.models.get(name)
        _tune_garbage_collector()
        for thread in self._threads.values():
            thread.start()
        self.lost.watch(self.worker_name)
        self.ready.set()

    def accept(self, message: Message) -> None:
        """Called by the consumer for each message; must return at once."""
        metrics.delivered(message)
        delivery = Delivery(message, self.clock())
        self.holdings.received(delivery)
        self.preparer.deliveries.put(delivery)

    def stalled_s(self) -> float:
        """How long the store has failed every write (0 while it makes progress); without end once one of
        the engine's threads has died (a bug of ours, or a model's ``SystemExit``): the worker then fetches
        nothing more and stops renewing its leases, so other workers take what it held, and says so."""
        if not self._stopping and self.ready.is_set():
            dead = [name for name, thread in self._threads.items() if not thread.is_alive()]
            if dead:
                if not self._dead_told:
                    log.critical(
                        "the engine's %s thread has died: this worker takes no more work and lets other "
                        "workers take what it held; restart it", ", ".join(dead),
                    )  # fmt: skip
                    self._dead_told = True
                return math.inf
        return self.storer.stalled_s()

    def _retune(self, models: set[str]) -> None:
        """Tuned limits changed (the watcher's thread): the lanes of those models take them at once."""
        with self._ready:
            for model in models:
                self.scheduler.reconfigure(model)
            self._ready.notify()

    def broker_lost_messages(self) -> None:
        """The broker came back empty: unfinished items end as lost after a grace period (lost_items.py)."""
        self.lost.after(self.settings.lost_grace_s)

    def stop(self, timeout_s: float = 60.0) -> None:
        """Stop after the batch in flight, storing and acknowledging what ran.

        Messages whose items did not all run stay unacknowledged; the channel hands them back when it
        closes. A store that cannot write gives up after a short wait instead of holding shutdown.
        """
        self._stopping = True  # its threads end now: that is no death (stalled_s)
        threads = self._threads
        self.lost.stop()
        self.preparer.deliveries.put(None)
        threads["prepare"].join(timeout_s)
        self.runner.stop()
        threads["run"].join(timeout_s)
        self.cancels.stop()
        self.storer.work.put(None)
        deadline = time.monotonic() + timeout_s
        while threads["store"].is_alive() and time.monotonic() < deadline:
            if self.storer.stalled_s() > STOP_STALLED_S:
                self.storer.stop()
            threads["store"].join(0.5)
        self.tuned.stop()


def _tune_garbage_collector() -> None:
    """A worker holds up to hundreds of thousands of items, each a few small objects, and makes as many per
    second. CPython's default collector then runs a young collection every 700 allocations and scans that
    whole population again and again: about a quarter of a noop worker's CPU. What exists at start-up
    (modules, weights) is frozen out of every scan; collections run per 50,000 allocations, full ones rarely.
    Nothing here is cyclic garbage by design, so this only changes when reference cycles are collected.
    """
    gc.freeze()
    gc.set_threshold(50_000, 50, 1000)
