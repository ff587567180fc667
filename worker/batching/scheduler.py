"""The pure scheduling core: which items run together, and when.

Items wait in lanes (model x priority), and inside a lane in length buckets. A lane is ready when a
bucket holds N items or a full token budget, or when its oldest item has waited T; the scheduler
hands out a batch from the most urgent ready lane, with aging so that no lane starves. It also keeps each
model's batch-size cap after running out of memory. This module knows items, lengths and a clock reading,
and must never import Celery, Redis, SQLAlchemy or torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from operator import attrgetter

from worker.batching.buckets import Item, LaneKey
from worker.batching.lanes import LaneQueue
from worker.batching.policy import LanePolicy

__all__ = ["Batch", "Item", "LaneKey", "Scheduler", "SizeLimit"]


@dataclass(frozen=True, slots=True)
class Batch:
    key: LaneKey  # (model, lane): the lane the batch came from
    items: tuple[Item, ...]
    formed_at: float

    @property
    def model(self) -> str:
        return self.key[0]

    @property
    def lane(self) -> str:
        """The lane's name (its priority), as everywhere else a lane is named."""
        return self.key[1]

    @property
    def real_tokens(self) -> int:
        return sum(map(_LENGTH, self.items))

    @property
    def padded_tokens(self) -> int:
        return max(map(_LENGTH, self.items)) * len(self.items)

    @property
    def oldest_wait_s(self) -> float:
        return self.formed_at - min(map(_ARRIVED, self.items))


_LENGTH = attrgetter("length")
_ARRIVED = attrgetter("arrived")


class Scheduler:
    """Lanes of waiting items; ``next_batch`` decides what the model runs next."""

    def __init__(self, policy_for: Callable[[LaneKey], LanePolicy]) -> None:
        self._policy_for = policy_for
        self._lanes: dict[LaneKey, LaneQueue] = {}
        self._limits: dict[
            str, SizeLimit
        ] = {}  # per model: the batch size trusted since it ran out of memory

    def add(self, model: str, priority: str, item: Item) -> None:
        self._lane(model, priority).add(item)

    def add_run(self, model: str, priority: str, items: list[Item]) -> None:
        """Add items of ONE job in arrival order (a message's items) at once: as ``add`` of each in turn,
        at a fraction of the cost per item."""
        self._lane(model, priority).add_run(items)

    def _lane(self, model: str, priority: str) -> LaneQueue:
        key = (model, priority)
        lane = self._lanes.get(key)
        if lane is None:
            lane = self._lanes[key] = LaneQueue(key, self._policy_for(key), self._cap(model))
        return lane

    def reconfigure(self, model: str | None = None) -> None:
        """Ask ``policy_for`` again for every lane of ``model`` (None: of every model), whose limits changed
        while items wait (tuned limits applied)."""
        for key, lane in self._lanes.items():
            if model is None or key[0] == model:
                lane.reconfigure(self._policy_for(key), self._cap(key[0]))

    def batch_ran(
        self, batch: Batch, out_of_memory_at: int | None, largest_ok: int
    ) -> tuple[bool, int | None]:
        """Learn from a batch that ran: a model's N drops at once when it ran out of memory (to what ran) and
        grows back slowly after (see SizeLimit). Whether its cap changed, and the cap (None: its N)."""
        limit = self._limits.setdefault(batch.model, SizeLimit())
        before = limit.cap
        if out_of_memory_at is not None:
            limit.ran_out_of_memory(out_of_memory_at, largest_ok)
        else:
            limit.succeeded(len(batch.items), self._lanes[batch.key].configured.max_batch_size)
        if limit.cap == before:
            return False, limit.cap
        for (model, _), lane in self._lanes.items():
            if model == batch.model:
                lane.cap_size(limit.cap)
        return True, limit.cap

    def __len__(self) -> int:
        return sum(lane.size for lane in self._lanes.values())

    def next_batch(self, now: float) -> Batch | None:
        """The batch to run now, or None if no lane is ready.

        The most urgent ready lane goes first, except that a lane whose oldest item waited past its
        starvation bound goes before all lanes that have not (oldest first among those). Lanes of
        continuously batched models are left to ``admit_next``.
        """
        ready = [lane for lane in self._waiting(continuous=False) if lane.is_ready(now)]
        if not ready:
            return None
        lane = _most_urgent(ready, now)
        return Batch(lane.key, tuple(lane.take(now)), now)

    def admit_next(self, model: str, now: float, fits: Callable[[Item], bool]) -> Item | None:
        """The next item to join ``model``'s running batch (continuous batching), if it ``fits``.

        The lane is chosen as for batches (urgency, then aging); within it, the oldest item goes.
        """
        lanes = [lane for lane in self._waiting(continuous=True) if lane.key[0] == model]
        if not lanes:
            return None
        lane = _most_urgent(lanes, now)
        return lane.pop_oldest(now) if fits(lane.peek_oldest()) else None

    def waiting_for(self, model: str) -> int:
        return sum(lane.size for key, lane in self._lanes.items() if key[0] == model)

    def next_deadline(self) -> float | None:
        """When the earliest lane becomes ready by waiting alone, or None when nothing waits."""
        return min((lane.deadline() for lane in self._waiting(continuous=False)), default=None)

    def _cap(self, model: str) -> int | None:
        limit = self._limits.get(model)
        return None if limit is None else limit.cap

    def _waiting(self, *, continuous: bool) -> Iterator[LaneQueue]:
        return (lane for lane in self._lanes.values() if lane.size and lane.policy.continuous == continuous)


def _most_urgent(lanes: list[LaneQueue], now: float) -> LaneQueue:
    """A lane past its starvation bound first (the longest waiting of those), else the lowest rank."""
    starving = [lane for lane in lanes if lane.starving(now)]
    if starving:
        return min(starving, key=LaneQueue.oldest_arrival)
    return min(lanes, key=lambda lane: (lane.policy.rank, lane.oldest_arrival()))


# -- the size cap after running out of memory: down at once, back up slowly ------------------------------
# Pure arithmetic on batch sizes (additive increase, multiplicative decrease): the run thread reports what
# happened (batch_ran) and every lane of the model takes the resulting cap.


@dataclass
class SizeLimit:
    """The largest batch a model is trusted with now; None means its configured N."""

    grow_after: int = 20  # successful batches at the cap before trying a larger one
    cap: int | None = None
    _proven: int = 0  # the largest batch that ran since the last out-of-memory error
    _successes: int = 0

    def ran_out_of_memory(self, size: int, largest_ok: int) -> None:
        """A batch of ``size`` ran out of memory; sub-batches of ``largest_ok`` ran (0: none did)."""
        probing = self.cap is not None and self._proven and self._proven < size
        if probing:
            # A larger size was tried and failed: go back to what worked, and probe less often.
            self.grow_after = min(self.grow_after * 2, 10_000)
        self.cap = (
            max(1, largest_ok, self._proven if probing else 0) if largest_ok or probing else max(1, size // 2)
        )
        self._proven = largest_ok
        self._successes = 0

    def succeeded(self, size: int, configured: int) -> None:
        self._proven = max(self._proven, size)
        if self.cap is None or size < self.cap:
            return
        self._successes += 1
        if self._successes < self.grow_after:
            return
        self._successes = 0
        grown = self.cap + max(1, self.cap // 8)
        self.cap = None if grown >= configured else grown
