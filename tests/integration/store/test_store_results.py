"""ResultStore on SQLite and PostgreSQL: results in order and in pages, batch records, concurrent
redelivery, generated tokens."""

from __future__ import annotations

import io
import random
import threading
from datetime import UTC, datetime, timedelta
from itertools import islice
from typing import Any

import numpy as np
import orjson
import pytest
from sqlalchemy import event

from tests.integration.stored import batch, err, new_job, ok, write
from worker.jsonl import write_results
from worker.store import results as results_module
from worker.store.results import ItemRecord, JobSpec, ResultStore, TokenCount


def test_results_come_back_ordered_with_outputs_intact(store: ResultStore) -> None:
    job = new_job(total=6)
    store.create_job(job)
    embedding = np.random.default_rng(7).standard_normal(384).astype(np.float32)
    outcomes = [
        ItemRecord(job.job_id, 0, "a", output=embedding),
        ItemRecord(
            job.job_id, 1, None, output={"text": "héllo ✓", "tokens": [1, 2, 3], "nested": {"x": None}}
        ),
        ItemRecord(job.job_id, 2, "c", error="field 'text' must be a string"),
        ItemRecord(job.job_id, 3, "d", output=np.float32(0.1)),
        ItemRecord(job.job_id, 4, "e", output="plain string"),
        ItemRecord(job.job_id, 5, "f", output=[]),
    ]
    shuffled = random.Random(3).sample(outcomes, len(outcomes))
    write(store, job, shuffled[:3])
    write(store, job, shuffled[3:])

    stored = list(store.results(job.job_id))

    assert [outcome.index for outcome in stored] == [0, 1, 2, 3, 4, 5]
    assert [outcome.item_id for outcome in stored] == ["a", None, "c", "d", "e", "f"]
    vector = np.asarray(stored[0].output, dtype=np.float32)
    assert vector.shape == (384,)
    assert np.array_equal(vector.view(np.uint32), embedding.view(np.uint32))
    assert stored[1].output == {"text": "héllo ✓", "tokens": [1, 2, 3], "nested": {"x": None}}
    assert (stored[2].output, stored[2].error) == (None, "field 'text' must be a string")
    assert np.float32(stored[3].output) == np.float32(0.1)
    assert (stored[4].output, stored[5].output) == ("plain string", [])


def test_results_stream_across_pages(store: ResultStore, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(results_module, "RESULTS_PAGE_SIZE", 3)
    job = new_job(total=10)
    write(store, job, [ok(job, i) for i in range(10)])

    assert [outcome.index for outcome in store.results(job.job_id)] == list(range(10))


def test_a_batch_larger_than_the_bound_parameter_limits_is_stored_whole(store: ResultStore) -> None:
    # 10,000 rows x 7 columns is past SQLite's 32,766 and PostgreSQL's 65,535 bound parameters.
    job = new_job(total=10_000)

    assert write(store, job, [ok(job, i) for i in range(10_000)]) == 10_000

    status = store.status(job.job_id)
    assert status is not None
    assert (status.state, status.done) == ("succeeded", 10_000)
    assert sum(1 for _ in store.results(job.job_id)) == 10_000


def test_write_batch_creates_jobs_not_created_before(store: ResultStore) -> None:
    first, second = new_job(total=2, priority="high"), new_job(total=3, model="minilm")
    outcomes = [ok(first, 0), ok(first, 1), err(second, 0)]

    assert store.write_batch(batch(3), outcomes, [first, second]) == 3

    one, two = store.status(first.job_id), store.status(second.job_id)
    assert one is not None and two is not None
    assert (one.state, one.total, one.priority, one.done) == ("succeeded", 2, "high", 2)
    assert (two.state, two.total, two.model, two.failed) == ("running", 3, "minilm", 1)


def test_outcomes_refused_before_batching_are_stored_without_a_batch(store: ResultStore) -> None:
    job = new_job(total=2)

    assert store.write_batch(None, [err(job, 0), err(job, 1)], [job]) == 2

    status = store.status(job.job_id)
    assert status is not None
    assert (status.state, status.failed) == ("failed", 2)
    assert [outcome.error for outcome in store.results(job.job_id)] == [err(job, 0).error, err(job, 1).error]
    assert store.recent_batches() == []


def test_write_batch_refuses_outcomes_without_a_job_spec(store: ResultStore) -> None:
    job = new_job()

    with pytest.raises(ValueError, match=job.job_id):
        store.write_batch(batch(1), [ok(job, 0)], [])

    assert store.status(job.job_id) is None


def test_outcome_needs_exactly_one_of_output_and_error() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        ItemRecord("job", 0, None)
    with pytest.raises(ValueError, match="exactly one"):
        ItemRecord("job", 0, None, output=[1.0], error="boom")


def test_batches_are_recorded_newest_first(store: ResultStore) -> None:
    job, other = new_job(total=4), new_job(total=1)
    start = datetime(2025, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)
    older, newer = batch(2, start), batch(2, start + timedelta(seconds=1))
    unrelated = batch(1, start + timedelta(seconds=2), model="simulated")
    store.write_batch(older, [ok(job, 0), ok(job, 1)], [job])
    store.write_batch(newer, [ok(job, 2), ok(job, 3)], [job])
    store.write_batch(unrelated, [ok(other, 0)], [other])

    assert store.recent_batches() == [unrelated, newer, older]
    assert store.recent_batches(job.job_id) == [newer, older]
    assert store.recent_batches(job.job_id, limit=1) == [newer]
    assert store.recent_batches()[0].started_at.tzinfo is not None


@pytest.mark.parametrize("redelivered", [False, True])
def test_a_group_of_batches_keeps_each_rows_batch_and_counts_each_batch(
    store: ResultStore, redelivered: bool
) -> None:
    # One transaction of three writes (two batches and outcomes refused before batching) of three jobs; with
    # one row stored already, that row is neither stored again nor counted. Each row keeps its own batch.
    first, second, third = new_job(total=2), new_job(total=3), new_job(total=1)
    one, two = batch(2, model="minilm"), batch(3, model="simulated")
    if redelivered:
        store.write_batch(None, [ok(second, 1)], [second])

    stored = store.write_batches(
        [
            (one, [ok(first, 0), err(first, 1)], [first]),
            (two, [ok(second, 0), ok(second, 1), ok(second, 2)], [second]),
            (None, [err(third, 0)], [third]),
        ]
    )

    assert stored.new_rows == [2, 2 if redelivered else 3, 1]
    assert store.recent_batches(first.job_id) == [one]
    assert store.recent_batches(second.job_id) == [two]
    assert store.recent_batches(third.job_id) == []
    states = [store.status(job.job_id) for job in (first, second, third)]
    assert [(s.state, s.done, s.failed) for s in states if s is not None] == [
        ("partial", 1, 1),
        ("succeeded", 3, 0),
        ("failed", 0, 1),
    ]
    assert all(s is not None and s.started_at and s.finished_at for s in states)
    assert [o.item_id for o in store.results(second.job_id)] == ["item-0", "item-1", "item-2"]


def test_concurrent_redelivery_counts_each_item_once(store: ResultStore) -> None:
    # Four workers write the same 200 items in different orders: as if every message were redelivered.
    job = new_job(total=200)
    store.create_job(job)
    outcomes = [ok(job, i) if i % 10 else err(job, i) for i in range(200)]
    inserted: list[int] = []

    def worker(seed: int) -> None:
        mine = random.Random(seed).sample(outcomes, len(outcomes))
        for start in range(0, len(mine), 20):
            inserted.append(store.write_batch(batch(20), mine[start : start + 20], [job]))

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    status = store.status(job.job_id)
    assert status is not None
    assert sum(inserted) == 200
    assert (status.state, status.done, status.failed) == ("partial", 180, 20)
    assert len(list(store.results(job.job_id))) == 200


def generated(job: JobSpec, index: int, tokens: int) -> ItemRecord:
    output = {"text": "x" * tokens, "tokens": tokens, "finish_reason": "length"}
    return ItemRecord(job.job_id, index, None, output=output, tokens=tokens)


def test_a_job_that_generates_nothing_has_no_token_count(store: ResultStore) -> None:
    job = new_job(total=2)
    write(store, job, [ok(job, 0)])

    status = store.status(job.job_id)
    assert status is not None
    assert (status.generated_tokens, status.running_tokens) == (None, None)


def test_generated_tokens_count_running_and_stored_items(store: ResultStore) -> None:
    job = new_job(total=3, model="gpt2")
    store.create_job(job)
    store.record_tokens([TokenCount(job.job_id, 0, 5), TokenCount(job.job_id, 1, 2)])
    store.record_tokens([TokenCount(job.job_id, 0, 9)])  # a later report replaces the earlier one
    assert _tokens(store, job) == (11, 11)

    write(store, job, [generated(job, 0, 12)])
    assert _tokens(store, job) == (14, 2)

    # The item's run reports after its result (a late or a redelivered run): the stored count stays.
    store.record_tokens([TokenCount(job.job_id, 0, 3)])
    write(store, job, [generated(job, 0, 40)])
    assert _tokens(store, job) == (14, 2)


def test_a_finished_job_counts_only_its_stored_tokens(store: ResultStore) -> None:
    job = new_job(total=2, model="gpt2")
    store.record_tokens([TokenCount(job.job_id, 1, 7)])  # a run that crashed before storing item 1
    write(store, job, [generated(job, 0, 4), err(job, 1)])

    status = store.status(job.job_id)
    assert status is not None and status.state == "partial"
    assert (status.generated_tokens, status.running_tokens) == (4, 0)


def _tokens(store: ResultStore, job: JobSpec) -> tuple[int | None, int | None]:
    status = store.status(job.job_id)
    assert status is not None
    return status.generated_tokens, status.running_tokens


@pytest.mark.parametrize(("after", "limit"), [(-1, None), (-1, 7), (4, None), (4, 3), (20, None)])
def test_result_lines_are_the_lines_write_results_writes(
    store: ResultStore, monkeypatch: pytest.MonkeyPatch, after: int, limit: int | None
) -> None:
    # PostgreSQL writes the NDJSON itself (GET /v1/jobs/{id}/results): byte for byte what the Python
    # writer makes of the same rows, across pages, for awkward ids, outputs and errors.
    monkeypatch.setattr(results_module, "RESULT_LINES_PAGE_SIZE", 4)
    job = new_job(total=12)
    outcomes = [
        ItemRecord(job.job_id, 0, 'q"uo\\te', output={"text": "héllo ✓ \u2028", "n": [1.5, -2, None]}),
        ItemRecord(job.job_id, 1, None, output="tab\there\nnewline \x01 \x1f"),
        ItemRecord(job.job_id, 2, "7", error='bad "input" \\ \n at line 3 ✗'),
        ItemRecord(job.job_id, 3, "e", output=np.float32(0.1)),
        ItemRecord(job.job_id, 4, "</script>", output=[]),
        ItemRecord(job.job_id, 5, "f", output=0),
        *(ItemRecord(job.job_id, i, f"id-{i}", output={"i": i}) for i in range(6, 12)),
    ]
    write(store, job, outcomes)

    expected = io.BytesIO()
    write_results(expected, islice(store.results(job.job_id, after=after), limit))
    lines = b"".join(store.result_lines(job.job_id, after=after, limit=limit))

    assert lines == expected.getvalue()
    assert [orjson.loads(line)["index"] for line in lines.splitlines()] == list(range(after + 1, 12))[:limit]


def test_generated_text_with_nul_and_every_escape_is_stored_intact(store: ResultStore) -> None:
    # A causal LM may generate any character: U+0000 (which PostgreSQL's jsonb and text refuse), other
    # control characters, lone surrogates' neighbours, and backslashes that look like escapes.
    job = new_job(total=2)
    store.create_job(job)
    text = 'a\x00b\x01\\u0000\t"\U0001f600\x7f'
    outputs = [{"text": text, "tokens": 9, "finish_reason": "length"}, "\x00"]
    write(store, job, [ItemRecord(job.job_id, i, None, output=output) for i, output in enumerate(outputs)])
    assert [outcome.output for outcome in store.results(job.job_id)] == outputs


@pytest.mark.parametrize("read", ["results", "result_lines"])
def test_the_pages_of_a_large_job_walk_the_primary_key_not_the_whole_job(
    pg_store: ResultStore, read: str
) -> None:
    # A fresh results table was never analyzed, so PostgreSQL believes a job holds a few hundred rows and
    # once planned every page as a bitmap scan of the job's remaining rows plus a sort: quadratic in the job
    # (a 1M-item job's first read took 65 s). Each page's plan is read here on the store's own connection.
    job = new_job(total=30_000)
    pg_store.create_job(job)
    write(pg_store, job, [ok(job, i) for i in range(30_000)])
    plans: list[str] = []

    def explain(conn: Any, cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        if "item_index >" in statement and not statement.startswith("EXPLAIN"):
            with conn.connection.cursor() as other:  # same transaction, so the page's settings hold
                other.execute("EXPLAIN " + statement, parameters)
                plans.append("\n".join(row[0] for row in other.fetchall()))

    event.listen(pg_store.engine, "after_cursor_execute", explain)
    try:
        rows = sum(1 for _ in getattr(pg_store, read)(job.job_id))
    finally:
        event.remove(pg_store.engine, "after_cursor_execute", explain)
    assert rows == (30_000 if read == "results" else 2)  # result_lines: a chunk per page of 20,000
    assert plans and all("Index Scan" in plan and "Sort" not in plan for plan in plans), plans[0]
