"""Builds tiny random GPT-2 checkpoints offline (weights from a fixed seed, a byte-level BPE trained on TEXT).

It must never download anything. The fixtures build each checkpoint once per test session into a tmp dir.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

EOS = "<|endoftext|>"
VOCAB_SIZE = 384
# Larger than GPT-2's 0.02: with 0.02 a 2-layer random model barely moves its residual stream and greedy
# decoding repeats the prompt's last token forever; 0.2 gives varied continuations and clear argmax gaps.
INITIALIZER_RANGE = 0.2
TEXT = """\
Batch inference gathers many small requests into one large call, because an accelerator does almost the
same work for one input as for sixty-four. A scheduler decides what runs next: it knows items, lanes,
lengths and deadlines, and nothing else. Continuous batching goes further for text generation: a
sequence that finishes leaves the batch at once, and a waiting one takes its place at the next step.
The key and value cache of every running sequence lives in pages, so sequences of different lengths sit
side by side without padding. When the cache runs short, the newest sequences are preempted and resumed
later from their prompt and the tokens they have generated so far. Greedy decoding always takes the most
likely token; sampling draws from the distribution, shaped by temperature, top-k and top-p, with a seed
of its own so that the same request gives the same text whatever else shares the batch.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs! 0123456789
"""
# Prompts whose greedy continuations pick the EOS of the EOS-prone variant.
PROBE_PROMPTS = ["The cache", "A scheduler decides", "Sampling draws from", "The quick brown fox"]


def build_tiny_gpt2(directory: Path) -> Path:
    """A 2-layer, 64-wide GPT-2 with its tokenizer, saved with save_pretrained into ``directory``."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    tokenizer = _tokenizer()
    tokenizer.save_pretrained(directory)
    config = GPT2Config(
        n_layer=2,
        n_head=2,
        n_embd=64,
        n_positions=128,
        vocab_size=len(tokenizer),
        initializer_range=INITIALIZER_RANGE,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    GPT2LMHeadModel(config).eval().save_pretrained(directory)
    return directory


def with_frequent_eos(source: Path, directory: Path) -> Path:
    """A copy of ``source`` whose EOS is the token its greedy decoding emits most often over PROBE_PROMPTS.

    Random weights almost never produce the real EOS, so this is how sequences get to finish by EOS.
    """
    shutil.copytree(source, directory, dirs_exist_ok=True)
    eos = _frequent_greedy_token(source)
    for name in ("config.json", "generation_config.json"):
        path = directory / name
        config = json.loads(path.read_text())
        config["eos_token_id"] = eos
        path.write_text(json.dumps(config, indent=2))
    return directory


def with_pytorch_bin(source: Path, directory: Path) -> Path:
    """A copy of ``source`` whose weights are in pytorch_model.bin instead of model.safetensors."""
    import torch
    from safetensors.torch import load_file

    shutil.copytree(source, directory, dirs_exist_ok=True)
    weights = directory / "model.safetensors"
    torch.save(load_file(str(weights)), directory / "pytorch_model.bin")
    weights.unlink()
    return directory


def _frequent_greedy_token(checkpoint: Path) -> int:
    import torch
    from transformers import AutoTokenizer, GPT2LMHeadModel

    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint), local_files_only=True)
    model = GPT2LMHeadModel.from_pretrained(str(checkpoint), local_files_only=True).eval()
    counts: Counter[int] = Counter()
    for prompt in PROBE_PROMPTS:
        ids = torch.tensor([tokenizer(prompt)["input_ids"]])
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=30, pad_token_id=0
        )
        counts.update(out[0, ids.shape[1] :].tolist())
    return counts.most_common(1)[0][0]


def _tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(TEXT.splitlines(), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS, bos_token=EOS)


@pytest.fixture(scope="session")
def tiny_gpt2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny GPT-2 checkpoint directory whose EOS is the tokenizer's (so rarely emitted)."""
    return build_tiny_gpt2(tmp_path_factory.mktemp("tiny_gpt2"))


@pytest.fixture(scope="session")
def tiny_gpt2_eos(tiny_gpt2: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same weights, with a frequently generated token as EOS."""
    return with_frequent_eos(tiny_gpt2, tmp_path_factory.mktemp("tiny_gpt2_eos"))
