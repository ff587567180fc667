"""What the scheduler orders: items waiting in a lane, and the batches it hands out.

Pure values; never imports an edge of the system.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter
from typing import Any

LaneKey = tuple[str, str]  # (model, priority)


# Not frozen: a frozen dataclass's __init__ costs several times a plain one, and the prepare thread makes one
# Item per item received (a 200,000-item job makes 200,000). Nothing changes an Item after it is made.
@dataclass(slots=True, unsafe_hash=True)
class Item:
    job_id: str
    index: int
    length: int  # cost in tokens (1 for models without a notion of length)
    arrived: float  # clock reading when the item entered the worker
    ref: Any = None  # the runtime's own handle (payload, message); opaque here


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
