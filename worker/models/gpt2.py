"""GPT-2-architecture text generation, continuously batched: sequences join, advance a token a step, and leave.

It must never import torch or transformers at module import (only ``load`` does), never reach a model hub
(everything comes from the BATCHWORK_GPT2_PATH directory), and never fail a sequence for lack of KV cache:
the newest running sequences are preempted and later resume by recomputing their cache.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeVar

from worker.models.base import Finished, InvalidInput, Prepared, StepModel
from worker.models.gpt2_cache import PagePool, pages_for
from worker.models.gpt2_inputs import Prompt, Request, check_request, context_tokens
from worker.settings import get_settings

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from worker.models.gpt2_network import GPT2Network
    from worker.settings import Settings

# Tokens per KV-cache page: small enough that a sequence wastes under a page, large enough that the
# page table of a 1024-token sequence stays 64 entries.
PAGE_TOKENS = 16
# Prompts prefilled together are padded to the longest of them; a group stops at this many padded tokens.
PREFILL_GROUP_TOKENS = 8192
T = TypeVar("T")
SETUP = (
    "set BATCHWORK_GPT2_PATH to a local Hugging Face GPT-2-format directory "
    "(config.json, model.safetensors or pytorch_model.bin, tokenizer files)"
)


@dataclass(frozen=True, slots=True)
class Generation:
    """A sequence that left: its generated token ids (an EOS included) and why it stopped, or its error."""

    key: Any
    token_ids: tuple[int, ...] = ()
    finish_reason: str | None = None  # "eos" or "length"
    error: str | None = None


@dataclass(eq=False)
class LiveSequence:
    """An admitted sequence. ``cached`` tokens of prompt + generated have keys and values in ``pages``;
    the newest generated token never has yet: the next decode step feeds it."""

    key: Any
    prompt: Prompt
    order: int  # admission order: the highest is the newest, preempted first
    generated: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    cached: int = 0
    generator: Any = None  # a torch.Generator when sampling

    @property
    def context(self) -> list[int]:
        """What a (re)prefill runs: the prompt and everything generated so far."""
        return [*self.prompt.token_ids, *self.generated]


class GPT2(StepModel):
    """GPT-2 text generation (greedy or seeded sampling), continuously batched over a paged KV cache."""

    name = "gpt2"
    max_running = 32
    max_batch_size = 32

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.preemptions = 0  # sequences whose cache was freed to make room; each resumed later
        self._admitted = 0
        self._waiting: list[LiveSequence] = []  # no cache: new or preempted, by admission order
        self._running: list[LiveSequence] = []  # with cache, by admission order
        self._rejected: list[LiveSequence] = []  # payloads that carry an error: they leave at the next step
        self._network: GPT2Network | None = None
        self._pool: PagePool | None = None
        # Two tokenizers: prepare may run on another thread than step, and a fast tokenizer is not safe
        # to encode on one thread while it decodes on another ("Already borrowed").
        self._encoder: PreTrainedTokenizerBase | None = None
        self._decoder: PreTrainedTokenizerBase | None = None
        self._sampling: ModuleType | None = None  # worker.models.gpt2_sampling, imported by load with torch
        self._context = 0

    # -- inputs (any thread) -----------------------------------------------------------------

    @classmethod
    def validate(cls, index: int, item: object, max_chars: int) -> None:
        # The producer's settings, to bound max_new_tokens by the real context when it can read it.
        check_request(index, item, max_chars, context_tokens(get_settings().gpt2_path))

    def load(self, device: str, *, dtype: str = "float32") -> None:
        """Read the checkpoint of BATCHWORK_GPT2_PATH onto ``device``; ``dtype`` float64 is for exact tests."""
        import torch
        from transformers import AutoTokenizer

        from worker.models import gpt2_sampling
        from worker.models.gpt2_network import GPT2Network, read_shape, read_weights

        checkpoint = checkpoint_dir(self.settings.gpt2_path)
        shape = read_shape(checkpoint)
        pool = PagePool(
            layers=shape.layers,
            heads=shape.heads,
            head_dim=shape.head_dim,
            pages=self.settings.gpt2_kv_budget_tokens // PAGE_TOKENS,
            page_tokens=PAGE_TOKENS,
            dtype=getattr(torch, dtype),
            device=device,
        )
        self._network = GPT2Network(shape, read_weights(checkpoint), pool, device)
        self._pool = pool
        self._context = shape.context_tokens
        # local_files_only: a missing tokenizer file must fail here, never turn into a download.
        self._encoder = AutoTokenizer.from_pretrained(str(checkpoint), local_files_only=True)
        self._decoder = AutoTokenizer.from_pretrained(str(checkpoint), local_files_only=True)
        self._sampling = gpt2_sampling

    def prepare(self, items: Sequence[object]) -> list[Prepared]:
        """Tokenize a whole message at once. Never raises for one item: an item that cannot run becomes a
        payload with an ``error`` (see ``check_lengths``), which leaves at the first step after it is admitted.
        """
        encoder = _loaded(self._encoder, "prepare")
        checked: list[Request | InvalidInput] = []
        for index, item in enumerate(items):
            try:
                checked.append(check_request(index, item, self.settings.max_input_chars, self._context))
            except InvalidInput as exc:
                checked.append(exc)
        prompts = [r.prompt for r in checked if isinstance(r, Request)]
        encoded = iter(encoder(prompts, return_attention_mask=False)["input_ids"] if prompts else [])
        return [
            self._prepared(r, next(encoded)) if isinstance(r, Request) else _rejected(r.detail) for r in checked
        ]

    def check_lengths(self, payloads: Sequence[Prompt]) -> list[str | None]:
        """Per prepared payload: why it cannot run (too long for the context or KV budget, or an invalid
        item), or None. The engine may store these errors at once instead of admitting the payloads."""
        return [payload.error for payload in payloads]

    def _prepared(self, request: Request, token_ids: list[int]) -> Prepared:
        prompt = Prompt(tuple(token_ids), request.max_new_tokens, request.sampling)
        error = self._length_error(prompt)
        return _rejected(error) if error else Prepared(prompt, prompt.kv_tokens)

    def _length_error(self, prompt: Prompt) -> str | None:
        tokens, total = len(prompt.token_ids), prompt.kv_tokens
        if tokens == 0:
            return "field 'prompt' has no tokens"
        need = f"the prompt has {tokens} tokens; with max_new_tokens {prompt.max_new_tokens} that is {total}"
        if total > self._context:
            return f"{need}, over the model's context of {self._context} tokens"
        budget = _loaded(self._pool, "prepare").pages * PAGE_TOKENS
        if pages_for(total, PAGE_TOKENS) * PAGE_TOKENS > budget:
            return f"{need}, over the KV-cache budget of {budget} (BATCHWORK_GPT2_KV_BUDGET_TOKENS)"
        return None

    # -- stepping (the engine's one model thread) --------------------------------------------

    def can_admit(self, length: int) -> bool:
        """Room for a sequence that may need ``length`` (= Prepared.length: prompt + max_new_tokens) KV tokens?

        Yes when a slot is free, no preempted sequence is waiting to resume (they go first), and the free
        pages hold the newcomer's whole worst case plus what is already promised: the full worst case of
        every admitted sequence not yet prefilled, and one page per running sequence for its next token.
        So admitting never preempts by itself; only running sequences outgrowing the cache later do.
        """
        pool = _loaded(self._pool, "can_admit")
        if self.running() >= self.max_running:
            return False
        if not self._running and not self._waiting:
            return True  # an idle model takes anything prepare let through, so the engine never stalls
        if any(seq.generated for seq in self._waiting):
            return False
        promised = sum(pages_for(seq.prompt.kv_tokens, PAGE_TOKENS) for seq in self._waiting)
        return pages_for(length, PAGE_TOKENS) + promised + len(self._running) <= pool.free_pages

    def admit(self, key: Any, payload: Any) -> None:
        if not isinstance(payload, Prompt):
            raise TypeError(f"GPT2.admit takes a payload from GPT2.prepare, not {type(payload).__name__}")
        self._admitted += 1
        seq = LiveSequence(key, payload, self._admitted)
        if payload.error is not None:
            self._rejected.append(seq)
            return
        if not payload.sampling.greedy:
            seq.generator = _loaded(self._sampling, "admit").new_generator(payload.sampling)
        self._waiting.append(seq)

    def running(self) -> int:
        return len(self._running) + len(self._waiting) + len(self._rejected)

    def step(self) -> list[Finished]:
        return [self._finished(generation) for generation in self.advance()]

    def advance(self) -> list[Generation]:
        """One step: every running sequence gains a token, waiting ones that fit are prefilled and gain
        their first; those that reached EOS or max_new_tokens leave, with their token ids."""
        rejected = [Generation(seq.key, error=seq.prompt.error) for seq in self._rejected]
        self._rejected = []
        decoding = self._make_room()
        joining = self._join()
        if decoding:
            self._decode(decoding)
        if joining:
            self._prefill(joining)
        return rejected + self._retire()

    def _make_room(self) -> list[LiveSequence]:
        """A page for every running sequence whose next token starts one, preempting the newest while short."""
        pool = _loaded(self._pool, "step")
        while True:
            full = [seq for seq in self._running if seq.cached == len(seq.pages) * PAGE_TOKENS]
            if len(full) <= pool.free_pages:
                break
            # Terminates: pages belong only to running sequences, and any one alone fits (prepare checked).
            self._preempt(self._running[-1])
        for seq in full:
            seq.pages.extend(pool.allocate(1))
        return list(self._running)

    def _preempt(self, seq: LiveSequence) -> None:
        _loaded(self._pool, "step").release(seq.pages)
        seq.pages, seq.cached = [], 0
        self._running.remove(seq)
        bisect.insort(self._waiting, seq, key=lambda s: s.order)
        self.preemptions += 1

    def _join(self) -> list[LiveSequence]:
        """Waiting sequences, oldest first and none overtaking, that get pages to be prefilled this step."""
        pool = _loaded(self._pool, "step")
        joining: list[LiveSequence] = []
        while self._waiting:
            seq = self._waiting[0]
            need = pages_for(len(seq.prompt.token_ids) + len(seq.generated), PAGE_TOKENS)
            # A resuming sequence also leaves the running ones a page each, or the next step would preempt it
            # straight away; a new one had that room promised by can_admit.
            spare = len(self._running) + len(joining) if seq.generated else 0
            if need + spare > pool.free_pages:
                break
            seq.pages = pool.allocate(need)
            joining.append(self._waiting.pop(0))
        self._running = sorted(self._running + joining, key=lambda s: s.order)
        return joining

    def _decode(self, seqs: list[LiveSequence]) -> None:
        network = _loaded(self._network, "step")
        logits = network.decode(
            [seq.generated[-1] for seq in seqs], [seq.cached for seq in seqs], [seq.pages for seq in seqs]
        )
        for seq in seqs:
            seq.cached += 1
        self._append_next(seqs, logits)

    def _prefill(self, seqs: list[LiveSequence]) -> None:
        network = _loaded(self._network, "step")
        for group in _prefill_groups(seqs):
            contexts = [seq.context for seq in group]
            logits = network.prefill(contexts, [seq.pages for seq in group])
            for seq, context in zip(group, contexts, strict=True):
                seq.cached = len(context)
            self._append_next(group, logits)

    def _append_next(self, seqs: list[LiveSequence], logits: Any) -> None:
        samplings = [seq.prompt.sampling for seq in seqs]
        choose = _loaded(self._sampling, "step").choose_tokens
        tokens = choose(logits, samplings, [seq.generator for seq in seqs])
        for seq, token in zip(seqs, tokens, strict=True):
            seq.generated.append(token)

    def _retire(self) -> list[Generation]:
        network, pool = _loaded(self._network, "step"), _loaded(self._pool, "step")
        done, staying = [], []
        for seq in self._running:
            if seq.generated[-1] in network.shape.eos_token_ids:
                reason = "eos"
            elif len(seq.generated) >= seq.prompt.max_new_tokens:
                reason = "length"
            else:
                staying.append(seq)
                continue
            pool.release(seq.pages)
            done.append(Generation(seq.key, tuple(seq.generated), reason))
        self._running = staying
        return done

    def _finished(self, generation: Generation) -> Finished:
        if generation.error is not None:
            return Finished(generation.key, error=generation.error)
        ids = generation.token_ids
        # The EOS counts as a generated token (as in generate's output) but is no part of the text.
        text_ids = ids[:-1] if generation.finish_reason == "eos" else ids
        text = _loaded(self._decoder, "step").decode(list(text_ids), skip_special_tokens=True)
        return Finished(generation.key, {"text": text, "tokens": len(ids), "finish_reason": generation.finish_reason})

    # -- whole runs, for benchmarks: the same engine batched three ways ------------------------

    def run_continuous(self, payloads: Sequence[Prompt]) -> list[Finished]:
        """Continuous batching: admit whenever ``can_admit`` allows, between every two steps."""
        queued = deque(enumerate(payloads))
        results: dict[Any, Finished] = {}
        while queued or self.running():
            while queued and self.can_admit(queued[0][1].kv_tokens):
                self.admit(*queued.popleft())
            results.update((done.key, done) for done in self.step())
        return [results[index] for index in range(len(payloads))]

    def run_static(self, payloads: Sequence[Prompt], batch_size: int | None = None) -> list[Finished]:
        """Static batching: admit a batch (``batch_size``, default max_running, as far as the cache allows),
        step until all of it has finished, then the next; ``batch_size=1`` runs one sequence at a time."""
        size = batch_size or self.max_running
        results: dict[Any, Finished] = {}
        index = 0
        while index < len(payloads):
            start = index
            while index < len(payloads) and index - start < size and self.can_admit(payloads[index].kv_tokens):
                self.admit(index, payloads[index])
                index += 1
            while self.running():
                results.update((done.key, done) for done in self.step())
        return [results[i] for i in range(len(payloads))]


def checkpoint_dir(setting: str | None) -> Path:
    """The checkpoint directory BATCHWORK_GPT2_PATH names, or an error saying how to set it."""
    if not setting:
        raise RuntimeError(f"the gpt2 model has no checkpoint: {SETUP}")
    path = Path(setting).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"BATCHWORK_GPT2_PATH={setting!r} has no config.json: {SETUP}")
    return path


def _prefill_groups(seqs: list[LiveSequence]) -> list[list[LiveSequence]]:
    """Prompts of similar length together, so padding to the longest of a group stays cheap."""
    groups: list[list[LiveSequence]] = []
    for seq in sorted(seqs, key=lambda s: len(s.prompt.token_ids) + len(s.generated)):
        length = len(seq.prompt.token_ids) + len(seq.generated)
        if groups and length * (len(groups[-1]) + 1) <= PREFILL_GROUP_TOKENS:
            groups[-1].append(seq)
        else:
            groups.append([seq])
    return groups


def _rejected(error: str) -> Prepared:
    # No tokens and no cache to promise: it only carries its error to the first step after admission.
    return Prepared(Prompt((), 0, error=error), 1)


def _loaded(part: T | None, caller: str) -> T:
    if part is None:
        raise RuntimeError(f"GPT2.{caller} called before load()")
    return part
