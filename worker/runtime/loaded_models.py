"""The models a worker has loaded, and how each of their lanes batches.

Models load on first use (or at start, ``BATCHWORK_PRELOAD``), from the prepare thread; the run thread only
reads what is loaded. A lane's policy comes from the model's own defaults, under the limits ``batchwork tune
--apply`` stored, under the deployment's ``BATCHWORK_BATCHING`` settings.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace
from typing import NamedTuple

from worker.batching.policy import LanePolicy, resolve_lane
from worker.batching.scheduler import LaneKey
from worker.models.base import Model, StepModel
from worker.models.registry import model_class
from worker.settings import BatchingSettings, Settings

# The lane of items that were running when a worker died: each batch holds one of them, ahead of all else.
ISOLATED = "isolated"
ISOLATED_POLICY = LanePolicy(max_batch_size=1, max_wait_s=0.0, rank=-1)
# A worker holds this many of its largest batches of normal or bulk items; before any model is loaded, as
# if its batches were FIRST_HOLD items.
HOLD_BATCHES = 4
FIRST_HOLD = 64


class Stepping(NamedTuple):
    """A model driven step by step, under the name its messages use (a registry name or import path)."""

    name: str
    model: StepModel


class LoadedModels:
    def __init__(self, settings: Settings, device: str, tuned: Callable[[str], BatchingSettings]) -> None:
        self.settings = settings
        self.device = device
        self.tuned = tuned  # a model's tuned limits on this device kind (runtime/tuned_watch.py), in memory
        self._loaded: dict[str, Model] = {}
        self._lock = threading.Lock()

    def get(self, name: str) -> Model:
        """The loaded model ``name``, loading it first if need be (raises what loading raised)."""
        model = self._loaded.get(name)
        if model is None:
            with self._lock:
                model = self._loaded.get(name)
                if model is None:
                    model = model_class(name, self.settings)(self.settings)
                    model.load(self.device)
                    self._loaded[name] = model
        return model

    def loaded(self, name: str) -> Model:
        """A model already loaded (by the prepare thread, before any of its items were queued)."""
        return self._loaded[name]

    def steppers(self) -> list[Stepping]:
        # list(): the prepare thread may add a model meanwhile; copying the items is atomic.
        return [Stepping(n, m) for n, m in list(self._loaded.items()) if isinstance(m, StepModel)]

    def hold_goal(self) -> int:
        """Items of one priority worth holding: a few of the largest normal or bulk batches the loaded models
        form (the next ones fill while one runs); a batch's worth of the default N before any is loaded."""
        sizes = [
            self.policy_for((name, priority)).max_batch_size
            for name in list(self._loaded)
            for priority in ("normal", "bulk")
        ]
        return HOLD_BATCHES * max(sizes, default=FIRST_HOLD)

    def policy_for(self, lane: LaneKey) -> LanePolicy:
        model, priority = lane
        cls = model_class(model, self.settings)
        if priority == ISOLATED:
            policy = ISOLATED_POLICY
        else:
            explicit = self.settings.batching.get(model)
            policy = resolve_lane(cls.default_policy(), priority, explicit, self.tuned(model))
        return replace(policy, continuous=True) if issubclass(cls, StepModel) else policy
