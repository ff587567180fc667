"""GPT-2 generation through a real worker on Redis + PostgreSQL equals transformers' greedy generate,
and `batchwork status` shows the tokens generated so far while a generation job runs.

Requests arrive at different times, so sequences join and leave the running batch; a small KV
budget forces preemptions on the way. Each stored output must equal the prompt run alone.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.models.test_gpt2_decoder import CASES, reference_ids
from tests.integration.processes import ROOT, produce, service_env, wait_finished, wait_until, workers
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
        redis_url,
        pg_url,
        model_options={"gpt2": {"path": str(tiny_gpt2_eos), "kv_budget_tokens": 160}},
        preload=["gpt2"],
    )
    with workers(env):
        first = produce(env, [{"via": "submit", "model": "gpt2", "inputs": items[:4]}])
        # Later requests join a batch that is already running.
        wait_until(
            # None until the worker's first token report (an idle worker may take up to 0.1 s to fetch).
            lambda: (store.status(first[0]).generated_tokens or 0) > 0,
            60,
            lambda: "the first requests never ran",
        )
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
        # As the text-generation pipeline decodes: this EOS is no special token, so it is part of the text.
        text = tokenizer.decode(expected, skip_special_tokens=True)
        assert (output["text"], output["tokens"], output["finish_reason"]) == (text, len(expected), reason), (
            item
        )
    assert {"eos", "length"} == {o["finish_reason"] for o in outputs}
    # Every stored output's tokens, and nothing still counted as running.
    counts = [(s.generated_tokens, s.running_tokens) for s in wait_finished(store, job_ids)]
    assert counts[0] == (sum(o["tokens"] for o in outputs[:4]), 0)
    assert counts[1:] == [(o["tokens"], 0) for o in outputs[4:]]


COUNTER = "tests.support.models:Counter"


@pytest.mark.slow
def test_status_shows_generated_tokens_while_items_run(
    redis_url: str, pg_url: str, pg_store: ResultStore
) -> None:
    # 20 ms a step, 4 running at once: at least 6 s (the longest item alone), so the job is still running
    # when the producer process has returned, however slowly a loaded machine ends it.
    counts = [300, 200, 125, 50, 25, 250]
    env = service_env(redis_url, pg_url, tokens_report_s="0.1", preload=[COUNTER])
    seen: list[tuple[int, int, int]] = []  # (stored items, generated tokens, by running items)
    with workers(env) as procs:
        [job_id] = produce(
            env, [{"via": "submit", "model": COUNTER, "inputs": [{"count": n} for n in counts]}]
        )
        deadline = time.monotonic() + 60
        while (status := pg_store.status(job_id)) is not None and status.finished_at is None:
            assert time.monotonic() < deadline, "\n".join(procs[0].log[-30:])
            if status.generated_tokens is not None:
                seen.append((status.done, status.generated_tokens, status.running_tokens or 0))
            time.sleep(0.05)
    assert status is not None and status.state == "succeeded"
    assert (status.generated_tokens, status.running_tokens) == (sum(counts), 0)
    # Seen mid-run: tokens of items still running, and a total that only grows.
    assert any(running > 0 and done < len(counts) for done, _, running in seen), seen
    totals = [total for _, total, _ in seen]
    assert totals == sorted(totals) and 0 < totals[-1] <= sum(counts), seen

    shown = subprocess.run(
        [sys.executable, "-m", "worker.cli", "status", job_id],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    assert f"generated_tokens  {sum(counts)} (0 by running items)" in shown, shown
