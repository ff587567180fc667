"""Text generation with any causal LM transformers loads, continuously batched: sequences join, gain a token
a step, and leave.

It must never import torch or transformers at module import (only ``load`` does), never reach a model hub
nor run a checkpoint's own code (everything comes from the local directory), and never fail a sequence for
lack of KV cache: the newest running sequences are preempted and later resume by recomputing their cache.
Which sequences run, join or give pages back each step is the pure core's (worker/batching/sequences.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

from pydantic import Field

from worker.batching.sequences import LiveSequence, RetiredSequence, SequenceScheduler, pages_for
from worker.models.base import FinishedSequence, ModelOptions, Prepared, StepModel
from worker.models.causal_lm.inputs import Prompt, Request, check_request, read_checkpoint

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from worker.models.causal_lm.cache import PagePool
    from worker.models.causal_lm.network import Shape
    from worker.settings import Settings

# Tokens per KV-cache page: small enough that a sequence wastes under a page, large enough that the
# page table of a 4096-token sequence stays 256 entries.
PAGE_TOKENS = 16
T = TypeVar("T")


class Forwards(Protocol):
    """The model side of a step (network.Network, or gpt2's own): forwards over ``pool``, logits out."""

    pool: PagePool

    def prefill(self, context: list[int], pages: list[int]) -> Any: ...

    def decode(self, tokens: list[int], positions: list[int], pages: list[list[int]]) -> Any: ...


class CausalLMOptions(ModelOptions):
    """A generate: entry's block of BATCHWORK_MODEL_OPTIONS."""

    # KV-cache tokens shared by all running sequences (pages of 16); past it the newest sequences are
    # preempted and later resume.
    kv_budget_tokens: int = Field(default=16_384, ge=16)
    # Sequences in one step (None: the class's max_running, 32).
    max_running: int | None = Field(default=None, ge=1, le=4096)


class CausalLM(StepModel):
    """Text generation with a local causal-LM checkpoint (greedy or seeded sampling), continuously batched."""

    name = "generate"
    kind = "generate"
    Options = CausalLMOptions
    max_running = 32
    max_batch_size = 32

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        limit = cast(CausalLMOptions, self.options()).max_running
        if limit is not None:
            self.max_running = limit  # type: ignore[misc]  # an instance's own limit over the class default
        self._network: Forwards | None = None
        self._scheduler: SequenceScheduler | None = None
        # Two tokenizers: prepare runs on the engine's prepare thread while step decodes on the model thread,
        # and one fast tokenizer used from two threads at once can fail with "RuntimeError: Already
        # borrowed" (huggingface/tokenizers#537, transformers#47085). Each is used by one thread only.
        self._encoder: PreTrainedTokenizerBase | None = None
        self._decoder: PreTrainedTokenizerBase | None = None
        self._sampling: ModuleType | None = None  # worker.models.causal_lm.sampling, imported by load
        self._context = 0
        self._eos: frozenset[int] = frozenset()

    # -- where the checkpoint is ---------------------------------------------------------------

    @classmethod
    def checkpoint_path(cls, settings: Settings) -> str | None:
        """The checkpoint directory: the entry's own (``NAME=generate:/dir``)."""
        return cls.checkpoint

    @classmethod
    def check_checkpoint(cls) -> object:
        """The entry's directory, its config.json (no remote code, a model type transformers knows) and its
        weights, read without loading them: one line before any work (a slow tokenizer is let be)."""
        if not cls.checkpoint:  # gpt2 names its directory in its options: checked as it loads
            return None
        from worker.models.checkpoint import check_hf_model, checked_directory

        label = f"generate:{cls.checkpoint}"
        return check_hf_model(checked_directory(cls.checkpoint, "generate"), label, classifier=False,
                              fast_tokenizer=False)  # fmt: skip

    @classmethod
    def checkpoint_dir(cls, settings: Settings) -> Path:
        """The checkpoint directory, or one line naming the path and what it lacks."""
        setting = cls.checkpoint_path(settings)
        if not setting:
            raise RuntimeError(
                f"model {cls.name!r} has no checkpoint directory (serve it as NAME=generate:/dir)"
            )
        path = Path(setting).expanduser()
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{cls.name}: {setting} has no config.json (not a checkpoint directory)")
        return path

    # -- figures ------------------------------------------------------------------------------

    @property
    def context_tokens(self) -> int:
        return self._context

    def kv_bytes_per_token(self) -> int:
        """Cache bytes one token takes: keys and values of every layer."""
        keys = _loaded(self._network, "kv_bytes_per_token").pool.keys
        layers, heads, _slots, head_dim = keys.shape
        return 2 * layers * heads * head_dim * keys.element_size()

    @property
    def preemptions(self) -> int:
        """Sequences whose cache was freed to make room (each resumed later), since load."""
        return _loaded(self._scheduler, "preemptions").preemptions

    # -- inputs (any thread) -----------------------------------------------------------------

    @classmethod
    def validate(cls, index: int, item: object, settings: Settings) -> Request:
        # The caller's settings bound max_new_tokens by the real context when they can read the checkpoint.
        checkpoint = read_checkpoint(cls.checkpoint_path(settings))
        return check_request(index, item, settings.max_input_chars, checkpoint)

    def load(self, device: str) -> None:
        """Read the checkpoint onto ``device`` in the ``precision`` option's dtype, attention ours."""
        from transformers import AutoTokenizer

        from worker.models.causal_lm import sampling
        from worker.models.causal_lm.network import DTYPES
        from worker.models.precision import UnsupportedPrecision, check_precision

        options = cast(CausalLMOptions, self.options())
        if options.precision not in DTYPES:
            raise UnsupportedPrecision(
                f"{self.name}: precision {options.precision} is not one of fp32, bf16, fp16"
            )
        check_precision(options.precision, device)
        checkpoint = self.checkpoint_dir(self.settings)
        self._network, shape = self.load_network(checkpoint, device)
        self._scheduler = SequenceScheduler(self._network.pool, self.max_running)
        self._context = shape.context_tokens
        self._eos = shape.eos_token_ids
        # local_files_only: a missing tokenizer file must fail here, never turn into a download.
        self._encoder = AutoTokenizer.from_pretrained(str(checkpoint), local_files_only=True)
        self._decoder = AutoTokenizer.from_pretrained(str(checkpoint), local_files_only=True)
        self._sampling = sampling

    def load_network(self, checkpoint: Path, device: str) -> tuple[Forwards, Shape]:
        """The checkpoint's forwards over a fresh KV pool of ``kv_budget_tokens``, and its shape: the model
        transformers loads, attention ours. The seam where a model with its own network (gpt2) plugs in."""
        from worker.models.causal_lm.network import Network, load_model, read_shape

        model = load_model(checkpoint, cast(CausalLMOptions, self.options()).precision, device)
        shape = read_shape(model)
        return Network(
            model, self.kv_pool(shape.layers, shape.kv_heads, shape.head_dim, device), device
        ), shape

    def kv_pool(self, layers: int, kv_heads: int, head_dim: int, device: str) -> PagePool:
        """A fresh paged KV pool of ``kv_budget_tokens`` in the ``precision`` option's dtype."""
        from worker.models.causal_lm.cache import PagePool
        from worker.models.causal_lm.network import DTYPES

        options = cast(CausalLMOptions, self.options())
        return PagePool(
            layers=layers,
            heads=kv_heads,
            head_dim=head_dim,
            pages=options.kv_budget_tokens // PAGE_TOKENS,
            page_tokens=PAGE_TOKENS,
            dtype=DTYPES[options.precision],
            device=device,
        )

    def prepare(self, checked: Sequence[Request]) -> list[Prepared]:
        """Tokenize a whole message at once. Never raises for one item: a prompt too long for the context or
        the KV budget becomes a payload with an ``error``; admitted, it leaves with it at the next step."""
        encoder = _loaded(self._encoder, "prepare")
        plain = [request.prompt for request in checked if request.prompt is not None]
        encoded = iter(encoder(plain, return_attention_mask=False)["input_ids"] if plain else [])
        prepared = []
        for request in checked:
            if request.prompt is not None:
                prepared.append(self._prepared(request, next(encoded)))
                continue
            if not encoder.chat_template:
                prepared.append(_rejected("field 'messages': the model's tokenizer has no chat template"))
                continue
            try:
                ids = _chat_ids(encoder, request.messages or ())
            except Exception as exc:  # a template that raises (bad roles, ...) fails this item alone
                prepared.append(_rejected(f"field 'messages': the chat template failed: {_one_line(exc)}"))
                continue
            prepared.append(self._prepared(request, ids))
        return prepared

    def _prepared(self, request: Request, token_ids: list[int]) -> Prepared:
        prompt = Prompt(tuple(token_ids), request.max_new_tokens, request.sampling, request.stop)
        error = self._length_error(prompt)
        return _rejected(error) if error else Prepared(prompt, prompt.kv_tokens)

    def _length_error(self, prompt: Prompt) -> str | None:
        tokens, total = len(prompt.token_ids), prompt.kv_tokens
        if tokens == 0:
            return "the prompt has no tokens"
        need = f"the prompt has {tokens} tokens; with max_new_tokens {prompt.max_new_tokens} that is {total}"
        if total > self._context:
            return f"{need}, over the model's context of {self._context} tokens"
        budget = _loaded(self._network, "prepare").pool.pages * PAGE_TOKENS
        if pages_for(total, PAGE_TOKENS) * PAGE_TOKENS > budget:
            return f"{need}, over the KV-cache budget of {budget} ({self.name}'s kv_budget_tokens option)"
        return None

    # -- stepping (the engine's one model thread) --------------------------------------------

    def can_admit(self, length: int) -> bool:
        """Room for a sequence needing up to ``length`` (Prepared.length) KV tokens? See SequenceScheduler."""
        return _loaded(self._scheduler, "can_admit").can_admit(length)

    def admit(self, key: Any, payload: Any) -> None:
        if not isinstance(payload, Prompt):
            raise TypeError(
                f"{type(self).__name__}.admit takes a payload from prepare, not {type(payload).__name__}"
            )
        generator = None
        if payload.error is None and not payload.sampling.greedy:
            generator = _loaded(self._sampling, "admit").new_generator(payload.sampling)
        _loaded(self._scheduler, "admit").admit(key, payload, generator)

    def running(self) -> int:
        return 0 if self._scheduler is None else self._scheduler.running()

    def progress(self) -> list[tuple[Any, int]]:
        return [] if self._scheduler is None else self._scheduler.progress()

    def step(self) -> list[FinishedSequence]:
        return [self._finished(generation) for generation in self.advance()]

    def abort(self, error: str) -> list[FinishedSequence]:
        return [
            FinishedSequence(gone.key, error=gone.error)
            for gone in _loaded(self._scheduler, "abort").abort(error)
        ]

    def advance(self) -> list[RetiredSequence]:
        """One step: every running sequence gains a token, waiting ones that fit are prefilled and gain
        their first; those that reached EOS, a stop string or max_new_tokens leave, with their token ids."""
        scheduler = _loaded(self._scheduler, "step")
        decoding, joining, rejected = scheduler.schedule()
        if decoding:
            self._decode(decoding)
        for seq in joining:
            self._prefill(seq)
        stopped = [seq.key for seq in (*decoding, *joining) if self._stopped(seq)]
        return rejected + scheduler.retire(self._eos, stopped)

    def _decode(self, seqs: list[LiveSequence]) -> None:
        network = _loaded(self._network, "step")
        logits = network.decode(
            [seq.generated[-1] for seq in seqs], [seq.cached for seq in seqs], [seq.pages for seq in seqs]
        )
        for seq in seqs:
            seq.cached += 1
        self._append_next(seqs, logits)

    def _prefill(self, seq: LiveSequence) -> None:
        # One sequence a forward: the same shapes as generate's own prefill, so the same rounding.
        context = seq.context
        logits = _loaded(self._network, "step").prefill(context, seq.pages)
        seq.cached = len(context)
        self._append_next([seq], logits)

    def _append_next(self, seqs: list[LiveSequence], logits: Any) -> None:
        # The core knows prompts only as its Prompt protocol; this model's carry their sampling too.
        samplings = [cast(Prompt, seq.prompt).sampling for seq in seqs]
        choose = _loaded(self._sampling, "step").choose_tokens
        tokens = choose(logits, samplings, [seq.generator for seq in seqs])
        for seq, token in zip(seqs, tokens, strict=True):
            seq.generated.append(token)

    def _stopped(self, seq: LiveSequence) -> bool:
        stop = cast(Prompt, seq.prompt).stop
        return bool(stop) and _stop_at(self._text(seq.generated), stop) is not None

    def _text(self, ids: Sequence[int]) -> str:
        # As the text-generation pipeline (return_full_text=False) decodes: the new ids, EOS included,
        # special tokens skipped.
        return str(_loaded(self._decoder, "step").decode(list(ids), skip_special_tokens=True))

    def _finished(self, generation: RetiredSequence) -> FinishedSequence:
        """A retired sequence's ids decoded into the output that is stored."""
        if generation.error is not None:
            return FinishedSequence(generation.key, error=generation.error)
        ids, prompt = generation.token_ids, cast(Prompt, generation.prompt)
        text = self._text(ids)
        if generation.finish_reason == "stop":
            text = text[: _stop_at(text, prompt.stop)]
        output = {
            "text": text,
            "tokens": len(ids),
            "finish_reason": generation.finish_reason,
            "prompt_tokens": len(prompt.token_ids),
        }
        return FinishedSequence(generation.key, output, tokens=len(ids))


def _stop_at(text: str, stop: Sequence[str]) -> int | None:
    """Where the first stop string begins in ``text``, or None."""
    found = [at for at in (text.find(s) for s in stop) if at >= 0]
    return min(found) if found else None


def _chat_ids(encoder: Any, messages: Sequence[tuple[str, str]]) -> list[int]:
    """The messages through the tokenizer's chat template, as the text-generation pipeline renders them:
    with the generation prompt, or continuing a final assistant message."""
    chat = [{"role": role, "content": content} for role, content in messages]
    continuing = chat[-1]["role"] == "assistant"
    rendered = encoder.apply_chat_template(
        chat, add_generation_prompt=not continuing, continue_final_message=continuing, return_dict=True
    )
    return list(rendered["input_ids"])


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())[:200] or type(exc).__name__


def _rejected(error: str) -> Prepared:
    # No tokens and no cache to promise: it only carries its error to the first step after admission.
    return Prepared(Prompt((), 0, error=error), 1)


def _loaded(part: T | None, caller: str) -> T:
    if part is None:
        raise RuntimeError(f"CausalLM.{caller} called before load()")
    return part
