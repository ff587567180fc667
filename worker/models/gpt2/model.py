"""GPT-2-architecture text generation, continuously batched: sequences join, gain a token a step, and leave.

It must never import torch or transformers at module import (only ``load`` does), never reach a model hub
(everything comes from the directory its ``path`` option names), and never fail a sequence for lack of KV
cache:
the newest running sequences are preempted and later resume by recomputing their cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeVar, cast

from pydantic import Field

from worker.batching.sequences import Generation, LiveSequence, SequenceScheduler, pages_for
from worker.models.base import Finished, ModelOptions, Prepared, StepModel
from worker.models.gpt2.cache import PagePool
from worker.models.gpt2.inputs import Prompt, Request, check_request, context_tokens
from worker.models.precision import UnsupportedPrecision

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from worker.models.gpt2.network import GPT2Network
    from worker.settings import Settings

# Tokens per KV-cache page: small enough that a sequence wastes under a page, large enough that the
# page table of a 1024-token sequence stays 64 entries.
PAGE_TOKENS = 16
# Prompts prefilled together are padded to the longest of them; a group stops at this many padded tokens.
PREFILL_GROUP_TOKENS = 8192
T = TypeVar("T")
SETUP = (
    'set BATCHWORK_MODEL_OPTIONS=\'{"gpt2": {"path": "/models/gpt2"}}\' to a local Hugging Face GPT-2-format '
    "directory (config.json, model.safetensors or pytorch_model.bin, tokenizer files)"
)


class GPT2Options(ModelOptions):
    """gpt2's block of BATCHWORK_MODEL_OPTIONS."""

    # A local GPT-2-format checkpoint directory; never downloaded.
    path: str | None = None
    # KV-cache tokens shared by all running sequences (pages of 16; n_layer * 2 * n_embd numbers a token,
    # 72 KiB for GPT-2 small in float32); past it the newest sequences are preempted and later resume.
    kv_budget_tokens: int = Field(default=16_384, ge=16)


class GPT2(StepModel):
    """GPT-2 text generation (greedy or seeded sampling), continuously batched over a paged KV cache."""

    name = "gpt2"
    kind = "generate"
    Options = GPT2Options
    max_running = 32
    max_batch_size = 32

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self._network: GPT2Network | None = None
        self._scheduler: SequenceScheduler | None = None
        # Two tokenizers: prepare runs on the engine's prepare thread while step decodes on the model thread,
        # and one fast tokenizer used from two threads at once can fail with "RuntimeError: Already
        # borrowed" (huggingface/tokenizers#537, transformers#47085). Each is used by one thread only.
        self._encoder: PreTrainedTokenizerBase | None = None
        self._decoder: PreTrainedTokenizerBase | None = None
        self._sampling: ModuleType | None = None  # worker.models.gpt2.sampling, imported by load with torch
        self._context = 0

    @property
    def context_tokens(self) -> int:
        return self._context

    def kv_bytes_per_token(self) -> int:
        """Cache bytes one token takes: keys and values of every layer (72 KiB for GPT-2 small)."""
        keys = _loaded(self._network, "kv_bytes_per_token").pool.keys
        layers, _pages, _page_tokens, heads, head_dim = keys.shape
        return 2 * layers * heads * head_dim * keys.element_size()

    @property
    def preemptions(self) -> int:
        """Sequences whose cache was freed to make room (each resumed later), since load."""
        return _loaded(self._scheduler, "preemptions").preemptions

    # -- inputs (any thread) -----------------------------------------------------------------

    @classmethod
    def validate(cls, index: int, item: object, settings: Settings) -> Request:
        # The caller's settings bound max_new_tokens by the real context when they name a checkpoint.
        path = cast(GPT2Options, cls.options_from(settings.model_options.get(cls.name, {}))).path
        return check_request(index, item, settings.max_input_chars, context_tokens(path))

    def load(self, device: str) -> None:
        """Read the checkpoint the ``path`` option names onto ``device``, in float32 however it was saved."""
        import torch
        from transformers import AutoTokenizer

        from worker.models.gpt2 import sampling as gpt2_sampling
        from worker.models.gpt2.network import GPT2Network, read_shape, read_weights

        if self.options().precision != "fp32":
            raise UnsupportedPrecision(
                "gpt2 runs in fp32 only for now (its KV cache and kernels are float32)"
            )
        options = cast(GPT2Options, self.options())
        checkpoint = checkpoint_dir(options.path)
        shape = read_shape(checkpoint)
        pool = PagePool(
            layers=shape.layers,
            heads=shape.heads,
            head_dim=shape.head_dim,
            pages=options.kv_budget_tokens // PAGE_TOKENS,
            page_tokens=PAGE_TOKENS,
            dtype=torch.float32,
            device=device,
        )
        self._network = GPT2Network(shape, read_weights(checkpoint), pool, device)
        self._scheduler = SequenceScheduler(pool, self.max_running)
        self._context = shape.context_tokens
        # local_files_only: a missing tokenizer file must fail here, never turn into a download.
        self._encoder = AutoTokenizer.from_pretrained(str(checkpoint), local_files_only=True)
        self._decoder = AutoTokenizer.from_pretrained(str(checkpoint), local_files_only=True)
        self._sampling = gpt2_sampling

    def prepare(self, checked: Sequence[Request]) -> list[Prepared]:
        """Tokenize a whole message at once. Never raises for one item: a prompt too long for the context or
        the KV budget becomes a payload with an ``error``; admitted, it leaves with it at the next step."""
        encoder = _loaded(self._encoder, "prepare")
        prompts = [request.prompt for request in checked]
        encoded = encoder(prompts, return_attention_mask=False)["input_ids"] if prompts else []
        return [self._prepared(request, ids) for request, ids in zip(checked, encoded, strict=True)]

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
        budget = _loaded(self._network, "prepare").pool.pages * PAGE_TOKENS
        if pages_for(total, PAGE_TOKENS) * PAGE_TOKENS > budget:
            return f"{need}, over the KV-cache budget of {budget} (gpt2's kv_budget_tokens option)"
        return None

    # -- stepping (the engine's one model thread) --------------------------------------------

    def can_admit(self, length: int) -> bool:
        """Room for a sequence needing up to ``length`` (Prepared.length) KV tokens? See SequenceScheduler."""
        return _loaded(self._scheduler, "can_admit").can_admit(length)

    def admit(self, key: Any, payload: Any) -> None:
        if not isinstance(payload, Prompt):
            raise TypeError(f"GPT2.admit takes a payload from GPT2.prepare, not {type(payload).__name__}")
        generator = None
        if payload.error is None and not payload.sampling.greedy:
            generator = _loaded(self._sampling, "admit").new_generator(payload.sampling)
        _loaded(self._scheduler, "admit").admit(key, payload, generator)

    def running(self) -> int:
        return 0 if self._scheduler is None else self._scheduler.running()

    def progress(self) -> list[tuple[Any, int]]:
        return [] if self._scheduler is None else self._scheduler.progress()

    def step(self) -> list[Finished]:
        return [self._finished(generation) for generation in self.advance()]

    def advance(self) -> list[Generation]:
        """One step: every running sequence gains a token, waiting ones that fit are prefilled and gain
        their first; those that reached EOS or max_new_tokens leave, with their token ids."""
        scheduler, network = _loaded(self._scheduler, "step"), _loaded(self._network, "step")
        decoding, joining, rejected = scheduler.schedule()
        if decoding:
            self._decode(decoding)
        if joining:
            self._prefill(joining)
        return rejected + scheduler.retire(network.shape.eos_token_ids)

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
        # The core knows prompts only as its Prompt protocol; this model's carry their sampling too.
        samplings = [cast(Prompt, seq.prompt).sampling for seq in seqs]
        choose = _loaded(self._sampling, "step").choose_tokens
        tokens = choose(logits, samplings, [seq.generator for seq in seqs])
        for seq, token in zip(seqs, tokens, strict=True):
            seq.generated.append(token)

    def _finished(self, generation: Generation) -> Finished:
        if generation.error is not None:
            return Finished(generation.key, error=generation.error)
        ids = generation.token_ids
        # The EOS counts as a generated token (as in generate's output) but is no part of the text.
        text_ids = ids[:-1] if generation.finish_reason == "eos" else ids
        text = _loaded(self._decoder, "step").decode(list(text_ids), skip_special_tokens=True)
        output = {"text": text, "tokens": len(ids), "finish_reason": generation.finish_reason}
        return Finished(generation.key, output, tokens=len(ids))


def checkpoint_dir(setting: str | None) -> Path:
    """The checkpoint directory gpt2's ``path`` option names, or an error saying how to set it."""
    if not setting:
        raise RuntimeError(f"the gpt2 model has no checkpoint: {SETUP}")
    path = Path(setting).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"gpt2's path {setting!r} has no config.json: {SETUP}")
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
