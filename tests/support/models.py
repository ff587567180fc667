"""The tests' own models, named by import path (``tests.support.models:Echo``): no weights, no torch.

Echo returns a checkable function of its input (LengthEcho too, batching by length); Poison,
OutOfMemoryAbove16 and Crash fail on purpose (an exception, CUDA's out-of-memory error, the worker process
dying); Counter is a user's own step model.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from worker.models.base import FinishedSequence, InvalidInput, Model, Prepared, StepModel


class Echo(Model):
    """Returns each item's text and its length in characters."""

    name = "echo"
    max_batch_size = 16
    max_wait_ms = 10.0

    def forward(self, payloads: Sequence[str]) -> list[dict[str, object]]:
        return [{"echo": text, "n": len(text)} for text in payloads]


class LengthEcho(Echo):
    """Echo for a model that batches by length: an item's length is its characters, in buckets of 8."""

    name = "length-echo"
    max_batch_size = 32
    bucket_edges = tuple(range(8, 513, 8))

    def prepare(self, checked: Sequence[str]) -> list[Prepared]:
        return [Prepared(text, len(text)) for text in checked]


class Poison(Model):
    """Echoes each text's length, but a batch holding the text "poison" raises, like a crashing tokenizer."""

    name = "poison"
    max_batch_size = 32
    max_wait_ms = 20

    def forward(self, payloads: Sequence[Any]) -> list[int]:
        if "poison" in payloads:
            raise ValueError("cannot digest 'poison'")
        return [len(text) for text in payloads]


class OutOfMemoryAbove16(Model):
    """Raises torch's CUDA out-of-memory error for any batch of more than 16 items."""

    name = "oom16"
    max_batch_size = 64
    max_wait_ms = 20

    def forward(self, payloads: Sequence[Any]) -> list[int]:
        import torch

        if len(payloads) > 16:
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {len(payloads)} GiB")
        return [len(text) for text in payloads]


class Crash(Model):
    """Kills its own worker process (as a segfault or the OOM killer would) on the text "crash"; else echoes
    each text's length."""

    name = "crash"
    max_batch_size = 8
    max_wait_ms = 20

    def forward(self, payloads: Sequence[Any]) -> list[int]:
        if "crash" in payloads:
            os._exit(9)
        return [len(text) for text in payloads]


STEP_S = 0.02


class Counter(StepModel):
    name = "counter"
    max_running = 4

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._running: dict[Any, tuple[int, list[int]]] = {}

    @classmethod
    def validate(cls, index: int, item: object, settings: Any) -> int:
        if not isinstance(item, dict) or not isinstance(item.get("count"), int) or item["count"] < 1:
            raise InvalidInput('an item is {"count": n} with n >= 1', index)
        return item["count"]

    def prepare(self, checked: Sequence[int]) -> list[Prepared]:
        return [Prepared(count, count) for count in checked]

    def can_admit(self, length: int) -> bool:
        return len(self._running) < self.max_running

    def admit(self, key: Any, payload: Any) -> None:
        self._running[key] = (payload, [])

    def running(self) -> int:
        return len(self._running)

    def progress(self) -> list[tuple[Any, int]]:
        return [(key, len(counted)) for key, (_, counted) in self._running.items()]

    def step(self) -> list[FinishedSequence]:
        time.sleep(STEP_S)
        done = []
        for key, (count, counted) in list(self._running.items()):
            counted.append(len(counted) + 1)
            if len(counted) == count:
                del self._running[key]
                done.append(FinishedSequence(key, {"counted": counted}, tokens=count))
        return done


class StepFails(Counter):
    """Counter whose step raises while a sequence of count 13 runs (the device failing part way)."""

    name = "step-fails"

    def step(self) -> list[FinishedSequence]:
        if any(count == 13 for count, _ in self._running.values()):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return super().step()

    def abort(self, error: str) -> list[FinishedSequence]:
        gone = [FinishedSequence(key, error=error) for key in self._running]
        self._running.clear()
        return gone


class StepFailsNoAbort(Counter):
    """Counter whose step raises while a sequence of count 13 runs, and which has no ``abort`` (a custom model
    written before it existed); it also refuses to admit a count of 7."""

    name = "step-fails-no-abort"

    def admit(self, key: Any, payload: Any) -> None:
        if payload == 7:
            raise ValueError("seven is not admitted")
        super().admit(key, payload)

    def step(self) -> list[FinishedSequence]:
        if any(count == 13 for count, _ in self._running.values()):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return super().step()


# Counters that break the StepModel contract one way each: the engine must still end every item once.
class StepTwice(Counter):
    def step(self) -> list[FinishedSequence]:
        done = super().step()
        return done + done  # each sequence finished twice


class StepMadeUp(Counter):
    def step(self) -> list[FinishedSequence]:
        return [*super().step(), FinishedSequence("a key it never admitted", {"counted": []})]


class StepNeither(Counter):
    def step(self) -> list[FinishedSequence]:
        return [FinishedSequence(done.key) for done in super().step()]  # no output, no error


class StepNaN(Counter):
    def step(self) -> list[FinishedSequence]:
        return [FinishedSequence(done.key, float("nan")) for done in super().step()]


class StepNone(Counter):
    def step(self) -> list[FinishedSequence]:
        super().step()
        return None  # type: ignore[return-value]


class RunningFails(Counter):
    def running(self) -> int:
        raise RuntimeError("running() broke")


class CanAdmitFails(Counter):
    def can_admit(self, length: int) -> bool:
        raise RuntimeError("can_admit() broke")


class Exits(Model):
    """Echoes each text, but calls sys.exit() for "exit" and raises KeyboardInterrupt for "interrupt" (what
    no worker thread gets from a signal: here it stands for anything that ends a thread)."""

    name = "exits"
    max_batch_size = 8
    max_wait_ms = 5

    def forward(self, payloads: Sequence[str]) -> list[str]:
        if "exit" in payloads:
            sys.exit(3)
        if "interrupt" in payloads:
            raise KeyboardInterrupt
        return list(payloads)


class SlowEmbed(Model):
    """An embed model whose vector tells its input: [length of the text, 1.0, its first character's code];
    each batch takes 20 ms, so a batch of thousands of inputs is still running when a test kills a worker."""

    name = "slowembed"
    kind = "embed"
    max_batch_size = 16
    max_wait_ms = 5

    def forward(self, payloads: Sequence[str]) -> list[list[float]]:
        time.sleep(0.02)
        return [[float(len(text)), 1.0, float(ord(text[0]))] for text in payloads]


class ChatEcho(Model):
    """A generate model that answers a chat with its last message reversed (a completion with its prompt
    reversed), cut to max_new_tokens characters; one "token" per character."""

    name = "chatecho"
    kind = "generate"
    max_batch_size = 8
    max_wait_ms = 5

    @classmethod
    def validate(cls, index: int, item: object, settings: Any) -> Any:
        if not isinstance(item, dict) or ("prompt" in item) == ("messages" in item):
            raise InvalidInput("expected an object with 'prompt' or 'messages'", index)
        if "messages" in item:
            messages = item["messages"]
            if not all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages):
                raise InvalidInput("field 'messages' must hold objects with a string 'content'", index)
            text = messages[-1]["content"]
        else:
            text = item["prompt"]
        limit = item.get("max_new_tokens", 16)
        return (str(text), int(limit))

    def forward(self, payloads: Sequence[tuple[str, int]]) -> list[dict[str, object]]:
        outputs: list[dict[str, object]] = []
        for text, limit in payloads:
            reply = text[::-1][:limit]
            finish = "length" if len(text) > limit else "eos"
            outputs.append(
                {"text": reply, "tokens": len(reply), "finish_reason": finish, "prompt_tokens": len(text)}
            )
        return outputs
