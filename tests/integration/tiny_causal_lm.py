"""Builds tiny random causal-LM checkpoints offline: Llama, Qwen2, Mistral and Gemma from configs, each with
the byte-level BPE of tiny_gpt2.py and a simple chat template, saved with save_pretrained.

It must never download anything. Each generation config lists two EOS ids: the tokenizer's (which random
weights almost never emit) and the token the model's greedy decoding emits most, so sequences end by EOS
too, and "any id of generation_config.json's eos_token_id" is exercised.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from tests.integration.tiny_gpt2 import INITIALIZER_RANGE, PROBE_PROMPTS, _tokenizer, build_tiny_gpt2

CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CONTEXT = 128
ARCHITECTURES = ("llama", "qwen2", "mistral", "gemma")


def build_tiny_causal_lm(directory: Path, architecture: str) -> Path:
    """A 2-layer, 64-wide model of ``architecture`` with 4 query heads over 2 key/value heads."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = _tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    config = AutoConfig.for_model(
        architecture,
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=CONTEXT,
        initializer_range=INITIALIZER_RANGE,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=architecture == "gemma",
    )
    if architecture == "mistral":
        config.sliding_window = 24  # shorter than the tests' contexts, so the window is exercised
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(directory)
    _add_frequent_eos(directory, model, tokenizer)
    return directory


def _add_frequent_eos(directory: Path, model: object, tokenizer: object) -> None:
    import torch

    counts: Counter[int] = Counter()
    for prompt in PROBE_PROMPTS:
        ids = torch.tensor([tokenizer(prompt)["input_ids"]])  # type: ignore[operator]
        out = model.generate(  # type: ignore[attr-defined]
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=30, pad_token_id=0
        )
        counts.update(out[0, ids.shape[1] :].tolist())
    path = directory / "generation_config.json"
    config = json.loads(path.read_text())
    config["eos_token_id"] = [tokenizer.eos_token_id, counts.most_common(1)[0][0]]  # type: ignore[attr-defined]
    path.write_text(json.dumps(config, indent=2))


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every architecture's checkpoint, and gpt2 (the tiny GPT-2 with the chat template added)."""
    built = {
        name: build_tiny_causal_lm(tmp_path_factory.mktemp(f"tiny_{name}"), name) for name in ARCHITECTURES
    }
    gpt2 = build_tiny_gpt2(tmp_path_factory.mktemp("tiny_gpt2_chat"))
    config = json.loads((gpt2 / "tokenizer_config.json").read_text())
    (gpt2 / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (gpt2 / "tokenizer_config.json").write_text(json.dumps(config))
    return {**built, "gpt2": gpt2}
