"""The generate kind (``generate:/dir``) against transformers on tiny random checkpoints built offline:
Llama, Qwen2, Mistral (a sliding window shorter than the contexts), Gemma, and GPT-2.

Greedy ids equal ``generate(do_sample=False)`` token for token for every prompt, with ``messages`` input,
mixed prompt lengths and max_new_tokens, under a KV budget that forces preemption; texts equal the
text-generation pipeline's (return_full_text=False); a seed gives the same text in any company; stop
strings end the text before them; a prompt too long fails alone at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

from tests.integration.tiny_causal_lm import ARCHITECTURES, CONTEXT, tiny_checkpoints  # noqa: F401
from tests.integration.tiny_gpt2 import tiny_gpt2  # noqa: F401
from tests.support.batched_runs import Request, run_continuous
from worker.batching.sequences import RetiredSequence
from worker.errors import InvalidInput, SetupError
from worker.models.base import FinishedSequence
from worker.models.causal_lm import CausalLM
from worker.models.causal_lm.inputs import Prompt
from worker.models.registry import check_checkpoints, model_class
from worker.settings import Settings

ITEMS: list[dict[str, Any]] = [
    {"prompt": "Batch inference gathers many small requests into one large call,", "max_new_tokens": 40},
    {"prompt": "Hi", "max_new_tokens": 1},
    {"prompt": "The cache", "max_new_tokens": 60},
    {"prompt": "A", "max_new_tokens": 50},
    {"messages": [{"role": "user", "content": "Pack my box"}], "max_new_tokens": 30},
    {"prompt": "Greedy decoding always takes the most likely token;", "max_new_tokens": 35},
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "When the cache runs short?"},
        ],
        "max_new_tokens": 25,
    },
    {"prompt": "0123456789 lengths", "max_new_tokens": 12},
    {"prompt": "Sampling", "max_new_tokens": 55},
    {"prompt": "The key and value cache of every running sequence lives in pages", "max_new_tokens": 30},
]
SAMPLED = {"prompt": "Sampling draws from", "max_new_tokens": 30, "temperature": 0.9, "top_k": 50, "seed": 7}
ALL = (*ARCHITECTURES, "gpt2")


def engine(checkpoint: Path, kv_budget_tokens: int = 4096, max_running: int = 4) -> CausalLM:
    entry = f"generate:{checkpoint}"
    options = {entry: {"kv_budget_tokens": kv_budget_tokens, "max_running": max_running}}
    settings = Settings(models=[entry], model_options=options)
    model = model_class(entry, settings)(settings)
    assert isinstance(model, CausalLM)
    model.load("cpu")
    return model


def payloads(model: CausalLM, items: Sequence[object]) -> list[Prompt]:
    checked = [model.validate(index, item, model.settings) for index, item in enumerate(items)]
    return [prepared.payload for prepared in model.prepare(checked)]


def generations(model: CausalLM, prompts: Sequence[Prompt]) -> list[RetiredSequence]:
    """Admit all at once, without asking can_admit (the scheduler joins them as their prompts fit, so the
    ones running outgrow the cache), and advance until all leave: each prompt's RetiredSequence (its ids)."""
    done = dict[Any, RetiredSequence]()
    for key, prompt in enumerate(prompts):
        model.admit(key, prompt)
    while model.running():
        done.update((generation.key, generation) for generation in model.advance())
    return [done[index] for index in range(len(prompts))]


def finished(model: CausalLM, items: Sequence[object]) -> list[FinishedSequence]:
    prompts = payloads(model, items)
    return run_continuous(model, [Request(i, p, p.kv_tokens) for i, p in enumerate(prompts)])


def reference_ids(checkpoint: Path, items: Sequence[dict]) -> list[list[int]]:
    """transformers' greedy generate on each prompt alone (chat messages through the template)."""
    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), local_files_only=True).eval()
    outputs = []
    for item in items:
        if "messages" in item:
            ids = tokenizer.apply_chat_template(
                item["messages"], add_generation_prompt=True, return_dict=True
            )
            ids = torch.tensor([ids["input_ids"]])
        else:
            ids = torch.tensor([tokenizer(item["prompt"])["input_ids"]])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=item["max_new_tokens"],
            pad_token_id=tokenizer.eos_token_id,
        )
        outputs.append(out[0, ids.shape[1] :].tolist())
    return outputs


@pytest.mark.parametrize("architecture", ALL)
def test_greedy_equals_generate_token_for_token_under_preemption(
    architecture: str,
    tiny_checkpoints: dict[str, Path],  # noqa: F811
) -> None:
    checkpoint = tiny_checkpoints[architecture]
    # 96 KV tokens hold the largest sequence (about 60 tokens) alone but not the four that run side by side.
    model = engine(checkpoint, kv_budget_tokens=96)
    done = generations(model, payloads(model, ITEMS))
    assert [list(generation.token_ids) for generation in done] == reference_ids(checkpoint, ITEMS)
    assert model.preemptions > 0
    reasons = {generation.finish_reason for generation in done}
    # The tiny GPT-2 lists only the tokenizer's EOS, which it never emits; Gemma's never reaches its other.
    assert reasons == ({"length"} if architecture in ("gpt2", "gemma") else {"eos", "length"})


@pytest.mark.parametrize("architecture", ["llama", "gpt2"])
def test_outputs_are_the_pipelines_text(architecture: str, tiny_checkpoints: dict[str, Path]) -> None:  # noqa: F811
    checkpoint = tiny_checkpoints[architecture]
    model = engine(checkpoint)
    generator = pipeline("text-generation", model=str(checkpoint), device="cpu")
    tokenizer = generator.tokenizer
    expected_ids = reference_ids(checkpoint, ITEMS)
    for item, done, ids in zip(ITEMS, finished(model, ITEMS), expected_ids, strict=True):
        text_in = item.get("prompt") or item["messages"]
        reference = generator(
            text_in, max_new_tokens=item["max_new_tokens"], do_sample=False, return_full_text=False
        )
        text = reference[0]["generated_text"]
        if "messages" in item:
            text = text[-1]["content"] if isinstance(text, list) else text
            rendered = tokenizer.apply_chat_template(
                item["messages"], add_generation_prompt=True, return_dict=True
            )
            prompt_tokens = len(rendered["input_ids"])
        else:
            prompt_tokens = len(tokenizer(item["prompt"])["input_ids"])
        eos = set(model._eos)
        assert done.error is None
        assert done.output == {
            "text": text,
            "tokens": len(ids),
            "finish_reason": "eos" if ids[-1] in eos else "length",
            "prompt_tokens": prompt_tokens,
        }


def test_a_seed_gives_the_same_text_alone_or_in_company(tiny_checkpoints: dict[str, Path]) -> None:  # noqa: F811
    model = engine(tiny_checkpoints["qwen2"], kv_budget_tokens=96)
    alone = generations(model, payloads(model, [SAMPLED]))[0]
    company = generations(model, payloads(model, [*ITEMS[:3], SAMPLED, {**SAMPLED, "seed": 8}, *ITEMS[3:]]))
    assert model.preemptions > 0
    assert company[3].token_ids == alone.token_ids
    assert company[4].token_ids != alone.token_ids


def test_stop_strings_end_the_text_before_the_first(tiny_checkpoints: dict[str, Path]) -> None:  # noqa: F811
    model = engine(tiny_checkpoints["llama"])
    item = ITEMS[0]
    full = finished(model, [item])[0].output
    assert full["finish_reason"] == "length" and len(full["text"]) > 12
    later, earlier = full["text"][9:12], full["text"][4:6]
    stopped = finished(model, [{**item, "stop": [later, earlier]}, {**item, "stop": ["never in it \u2603"]}])
    assert stopped[0].output["text"] == full["text"][: full["text"].find(earlier)]
    assert stopped[0].output["finish_reason"] == "stop"
    assert stopped[0].output["tokens"] < full["tokens"]
    assert stopped[1].output == full


def test_a_prompt_too_long_fails_alone_at_once(tiny_checkpoints: dict[str, Path]) -> None:  # noqa: F811
    model = engine(tiny_checkpoints["mistral"], kv_budget_tokens=64)
    items = [
        {"prompt": "Hi", "max_new_tokens": 3},
        {"prompt": "Hi", "max_new_tokens": CONTEXT},  # 1 + 128 tokens: over the 128-token context
        {"prompt": "Hi", "max_new_tokens": 70},  # within the context, over the 64-token KV budget
    ]
    prompts = payloads(model, items)
    errors = [prompt.error for prompt in prompts]
    assert errors[0] is None
    assert errors[1] is not None and f"over the model's context of {CONTEXT} tokens" in errors[1]
    assert errors[2] is not None and "over the KV-cache budget of 64" in errors[2]
    for key, prompt in enumerate(prompts):
        model.admit(key, prompt)
    first = {done.key: done for done in model.step()}
    assert first[1].error == errors[1] and first[2].error == errors[2]
    assert 0 not in first
    rest = [done for _ in range(3) for done in model.step()]
    assert [done.output["tokens"] for done in rest] == [3]


def test_inputs_are_refused_in_one_line(tiny_checkpoints: dict[str, Path], tiny_gpt2: Path) -> None:  # noqa: F811
    entry = f"generate:{tiny_gpt2}"  # this tokenizer has no chat template
    settings = Settings(models=[entry])
    cls = model_class(entry, settings)
    message = {"messages": [{"role": "user", "content": "Hi"}], "max_new_tokens": 3}
    with pytest.raises(InvalidInput, match="no chat template; send 'prompt'"):
        cls.validate(0, message, settings)
    with pytest.raises(InvalidInput, match="exactly one of 'prompt' and 'messages'"):
        cls.validate(0, {**message, "prompt": "Hi"}, settings)
    with pytest.raises(InvalidInput, match="over the model's context of 128"):
        cls.validate(0, {"prompt": "Hi", "max_new_tokens": 129}, settings)
    with pytest.raises(InvalidInput, match="'stop' must be a list of non-empty strings"):
        cls.validate(0, {"prompt": "Hi", "max_new_tokens": 3, "stop": "x"}, settings)


@pytest.mark.parametrize("make", ["missing", "not_a_model"])
def test_a_bad_checkpoint_is_one_line_naming_the_path(make: str, tmp_path: Path) -> None:
    if make == "not_a_model":
        (tmp_path / "config.json").write_text('{"model_type": "no-such-architecture"}')
    directory = tmp_path if make == "not_a_model" else tmp_path / "absent"
    entry = f"generate:{directory}"
    settings = Settings(models=[entry])
    with pytest.raises((RuntimeError, FileNotFoundError)) as raised:
        model_class(entry, settings)(settings).load("cpu")
    assert str(directory) in str(raised.value) and "\n" not in str(raised.value)
    with pytest.raises(SetupError) as refused:  # and before any work: a worker's start, `batchwork run`
        check_checkpoints(settings)
    assert str(refused.value).startswith(f"{entry}: ") and "\n" not in str(refused.value)


def test_after_a_step_fails_every_sequence_ends_with_the_error_and_the_next_are_right(
    tiny_checkpoints: dict[str, Path],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    checkpoint = tiny_checkpoints["llama"]
    model = engine(checkpoint, kv_budget_tokens=96)
    for key, prompt in enumerate(payloads(model, ITEMS[:4])):
        model.admit(key, prompt)
    left = {g.key for g in model.advance()}  # "Hi" (one token) is done; the rest hold pages or wait
    network = model._network
    assert network is not None

    def fails(*args: object) -> None:
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(network, "decode", fails)
    with pytest.raises(RuntimeError):
        model.step()
    gone = model.abort("the model failed")
    assert sorted(g.key for g in gone) == sorted({0, 1, 2, 3} - left)
    assert {g.error for g in gone} == {"the model failed"}
    assert model.running() == 0
    monkeypatch.undo()
    # Every page came back: the same requests run again, under the same budget, to the reference's ids.
    done = generations(model, payloads(model, ITEMS))
    assert [list(generation.token_ids) for generation in done] == reference_ids(checkpoint, ITEMS)
