"""GPT-2 generation through a real worker on Redis + PostgreSQL equals transformers' greedy generate.

Requests arrive at different times, so sequences join and leave the running batch; a small KV
budget forces preemptions on the way. Each stored output must equal the prompt run alone.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.integration.processes import produce, service_env, wait_finished, workers
from tests.integration.test_gpt2_decoder import CASES, reference_ids
from worker.store.results import ResultStore


@pytest.mark.slow
def test_generation_through_the_pipeline_equals_greedy_generate(
    redis_url: str,
    pg_url: str,
    pg_store: ResultStore,
    tiny_gpt2_eos: Path,
) -> None:
    from transformers import AutoTokenizer

    store = pg_store
    items = [{"prompt": prompt, "max_new_tokens": n} for prompt, n, _ in CASES]
    env = service_env(
        redis_url, pg_url, gpt2_path=str(tiny_gpt2_eos), gpt2_kv_budget_tokens="160", preload=["gpt2"]
    )
    with workers(env):
        first = produce(env, [{"via": "submit", "model": "gpt2", "inputs": items[:4]}])
        time.sleep(0.3)  # later requests join a batch that is already running
        rest = produce(env, [{"via": "delay", "model": "gpt2", "inputs": [item]} for item in items[4:]])
        job_ids = first + rest
        statuses = wait_finished(store, job_ids, timeout_s=120)
    assert all(s.state == "succeeded" for s in statuses), statuses
    outputs = [r.output for r in store.results(first[0])] + [next(store.results(j)).output for j in rest]
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_gpt2_eos), local_files_only=True)
    eos = json.loads((tiny_gpt2_eos / "config.json").read_text())[
        "eos_token_id"
    ]  # the model's, not the tokenizer's
    for item, expected, output in zip(items, reference_ids(tiny_gpt2_eos, items), outputs, strict=True):
        reason = "eos" if expected and expected[-1] == eos else "length"
        text = tokenizer.decode([t for t in expected if t != eos])
        assert (output["text"], output["tokens"], output["finish_reason"]) == (text, len(expected), reason), (
            item
        )
    assert {"eos", "length"} == {o["finish_reason"] for o in outputs}
