"""Continuous batching's sequence scheduler: each decode step, which sequences run, which join, and which
give their KV-cache pages back.

Part of the pure core: it knows sequences, their token counts and a pool's free pages, and never imports
torch or an edge of the system (a model drives it through the Pages and Prompt protocols). It never fails a
sequence for lack of pages: it preempts the newest and resumes them later.
"""

from __future__ import annotations

import bisect
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, Protocol


def pages_for(tokens: int, page_tokens: int) -> int:
    """Pages that hold ``tokens`` tokens (ceiling division)."""
    return -(-tokens // page_tokens)


class Prompt(Protocol):
    """What the scheduler reads of a sequence's payload: its prompt, its token limit, or why it cannot run."""

    @property
    def token_ids(self) -> tuple[int, ...]: ...
    @property
    def max_new_tokens(self) -> int: ...
    @property
    def error(self) -> str | None: ...
    @property
    def kv_tokens(self) -> int: ...


class Pages(Protocol):
    """The accounting side of a PagePool."""

    page_tokens: int

    @property
    def free_pages(self) -> int: ...
    def allocate(self, count: int, after: int | None = None) -> list[int]:
        """``count`` free pages; ``after``: the sequence's last page, which the new ones should follow."""
        ...

    def release(self, pages: list[int]) -> None: ...


@dataclass(frozen=True, slots=True)
class RetiredSequence:
    """A sequence that left the scheduler: its generated token ids (an EOS included) and why it stopped, or
    its error. Token ids only: the model decodes them into its FinishedSequence (models/base.py)."""

    key: Any
    token_ids: tuple[int, ...] = ()
    finish_reason: str | None = None  # "eos", "stop" (the model said so) or "length"
    error: str | None = None
    prompt: Any = field(default=None, compare=False)  # the payload it was admitted with (a Prompt)


@dataclass(eq=False)
class LiveSequence:
    """An admitted sequence. The first ``cached`` tokens of its context have keys and values in ``pages``;
    its newest generated token never has yet, since the next decode step is what feeds it."""

    key: Any
    prompt: Prompt
    order: int  # admission order: the highest is the newest, the first to be preempted
    generated: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    cached: int = 0
    generator: Any = None  # a torch.Generator when sampling

    @property
    def context(self) -> list[int]:
        """What a (re)prefill runs: the prompt and everything generated so far."""
        return [*self.prompt.token_ids, *self.generated]


class SequenceScheduler:
    def __init__(self, pages: Pages, max_running: int) -> None:
        self.pages = pages
        self.max_running = max_running
        self.preemptions = 0  # caches freed to make room; every such sequence resumed later
        self._admitted = 0
        self._waiting: list[LiveSequence] = []  # no cache: new or preempted, by admission order
        self._running: list[LiveSequence] = []  # with cache, by admission order
        self._rejected: list[LiveSequence] = []  # payloads that carry an error: they leave at the next step

    def running(self) -> int:
        return len(self._running) + len(self._waiting) + len(self._rejected)

    def progress(self) -> list[tuple[Any, int]]:
        """(key, tokens generated) of every admitted sequence that has not left; a preempted one keeps
        its tokens (only its cache is recomputed)."""
        return [(seq.key, len(seq.generated)) for seq in (*self._running, *self._waiting)]

    def can_admit(self, length: int) -> bool:
        """Room for a sequence that may need ``length`` KV tokens (prompt + max_new_tokens)?

        Yes when a slot is free, no preempted sequence waits to resume (they go first), and the free pages
        hold the newcomer's whole worst case plus what is already promised: the worst case of every admitted
        sequence not yet prefilled, and one page per running sequence for its next token. So admission never
        preempts by itself; only running sequences outgrowing the cache later do.
        """
        if self.running() >= self.max_running:
            return False
        if not self._running and not self._waiting:
            return True  # idle takes anything prepare let through (it fits alone), so the engine never stalls
        if any(seq.generated for seq in self._waiting):
            return False
        promised = sum(self._pages_for(seq.prompt.kv_tokens) for seq in self._waiting) + len(self._running)
        return self._pages_for(length) + promised <= self.pages.free_pages

    def admit(self, key: Any, prompt: Prompt, generator: Any = None) -> None:
        self._admitted += 1
        seq = LiveSequence(key, prompt, self._admitted, generator=generator)
        (self._waiting if prompt.error is None else self._rejected).append(seq)

    def schedule(self) -> tuple[list[LiveSequence], list[LiveSequence], list[RetiredSequence]]:
        """This step's work: the running sequences to decode (each with room for one more token), the
        waiting ones to prefill (pages given), and the rejected ones, which leave now."""
        rejected = [RetiredSequence(seq.key, error=seq.prompt.error) for seq in self._rejected]
        self._rejected = []
        decoding = self._make_room()
        joining = self._join()
        return decoding, joining, rejected

    def retire(self, eos_token_ids: frozenset[int], stopped: Collection[Any] = ()) -> list[RetiredSequence]:
        """After a step: the sequences that reached EOS or max_new_tokens, or whose keys the model names in
        ``stopped`` (a stop string), leave and free their pages."""
        done, staying = [], []
        for seq in self._running:
            if seq.generated[-1] in eos_token_ids:
                reason = "eos"
            elif seq.key in stopped:
                reason = "stop"
            elif len(seq.generated) >= seq.prompt.max_new_tokens:
                reason = "length"
            else:
                staying.append(seq)
                continue
            self.pages.release(seq.pages)
            done.append(RetiredSequence(seq.key, tuple(seq.generated), reason, prompt=seq.prompt))
        self._running = staying
        return done

    def abort(self, error: str) -> list[RetiredSequence]:
        """Every admitted sequence leaves with ``error`` (a rejected one with its own) and frees its pages:
        a step failed part way, so no sequence's cache or tokens can be trusted to go on from."""
        every = [*self._running, *self._waiting]
        for seq in every:
            self.pages.release(seq.pages)
        gone = [RetiredSequence(seq.key, error=seq.prompt.error) for seq in self._rejected]
        gone += [
            RetiredSequence(seq.key, error=error, prompt=seq.prompt)
            for seq in sorted(every, key=lambda s: s.order)
        ]
        self._running, self._waiting, self._rejected = [], [], []
        return gone

    def _make_room(self) -> list[LiveSequence]:
        """A page for each running sequence whose next token starts one; preempts the newest while short."""
        while True:
            full = [seq for seq in self._running if seq.cached == len(seq.pages) * self.pages.page_tokens]
            if len(full) <= self.pages.free_pages:
                break
            # Terminates: only running sequences hold pages, and any one alone fits (prepare checked).
            self._preempt(self._running[-1])
        for seq in full:
            seq.pages.extend(self.pages.allocate(1, after=seq.pages[-1] if seq.pages else None))
        return list(self._running)

    def _preempt(self, seq: LiveSequence) -> None:
        self.pages.release(seq.pages)
        seq.pages, seq.cached = [], 0
        self._running.remove(seq)
        bisect.insort(self._waiting, seq, key=lambda s: s.order)
        self.preemptions += 1

    def _join(self) -> list[LiveSequence]:
        """Waiting sequences, oldest first and none overtaking, that get their pages to prefill this step."""
        joining: list[LiveSequence] = []
        while self._waiting:
            seq = self._waiting[0]
            need = self._pages_for(len(seq.prompt.token_ids) + len(seq.generated))
            # A resuming sequence also leaves the running ones a page each, or the next step would preempt it
            # straight away; a new one had that room promised by can_admit.
            spare = len(self._running) + len(joining) if seq.generated else 0
            if need + spare > self.pages.free_pages:
                break
            seq.pages = self.pages.allocate(need)
            joining.append(self._waiting.pop(0))
        self._running = sorted(self._running + joining, key=lambda s: s.order)
        return joining

    def _pages_for(self, tokens: int) -> int:
        return pages_for(tokens, self.pages.page_tokens)
