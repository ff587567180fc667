"""A batch's output written while its jobs run (api.batch_output) and files that expire, on PostgreSQL.

The writer appends only the lines whose inputs all have stored outcomes, in input order; its cursor is
committed with the bytes, so a writer that lost its lease writes nothing and the next one goes on from the
stored cursor: every line once. An expired file is gone (not found, not listed) and its bytes are swept.
"""

from __future__ import annotations

import uuid
from datetime import timedelta

import orjson
import pytest

from api.batch_output import Cursor, LeaseLost, OutputWriter
from api.batch_runner import job_id_for
from worker.errors import InvalidInput
from worker.openai_compat.batchfile import plan_batch
from worker.settings import Settings
from worker.store.files import BatchStore, FileRecord, FileStore, utcnow
from worker.store.results import JobSpec, ResultStore
from worker.store.values import ItemRecord

SETTINGS = Settings(models=["noop"])


def _lines(count: int) -> list[bytes]:
    def body(i: int) -> dict[str, object]:
        return {"model": "noop", "input": ["a", "b"] if i % 3 == 0 else "c"}

    return [
        orjson.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/embeddings", "body": body(i)})
        for i in range(count)
    ]


def _store_outcomes(store: ResultStore, spec: JobSpec, indices: range, failing: set[int]) -> None:
    outcomes = [
        ItemRecord(spec.job_id, index, None, error="boom")
        if index in failing
        else ItemRecord(spec.job_id, index, None, output=0)
        for index in indices
    ]
    store.write_batch(None, outcomes, [spec])


def test_the_output_is_written_in_order_as_results_come_and_resumed_from_the_cursor(
    pg_store: ResultStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    import api.batch_output as batch_output

    monkeypatch.setattr(batch_output, "MIN_APPEND_LINES", 1)
    monkeypatch.setattr(batch_output, "APPEND_LINES", 7)
    monkeypatch.setattr(batch_output, "APPEND_BYTES", 500)  # an append of 7 lines takes 3 transactions ...
    monkeypatch.setattr(batch_output, "CHUNK_BYTES", 100)  # ... each of several chunk rows
    files, batches = FileStore(pg_store.engine, pg_store.url), BatchStore(pg_store.engine, pg_store.url)
    plan = plan_batch(_lines(30), "/v1/embeddings", SETTINGS)
    items = len(plan.items["noop"])  # 40: every third line holds two inputs
    batch_id = f"batch_{uuid.uuid4().hex}"
    spec = JobSpec(job_id_for(batch_id, "noop"), "noop", "bulk", items)
    pg_store.create_job(spec)
    now = utcnow()
    batches.create(
        {
            "id": batch_id,
            "tenant": "t",
            "status": "in_progress",
            "endpoint": "/v1/embeddings",
            "input_file_id": "file-x",
            "completion_window": "24h",
            "created_at": now,
            "expires_at": now + timedelta(hours=1),
            "jobs": {"noop": spec.job_id},
            "total": 30,
        }
    )
    ids = (f"file-{uuid.uuid4().hex}", f"file-{uuid.uuid4().hex}")
    first = OutputWriter(files, batches, "first", 20.0)
    assert batches.claim(batch_id, "first", 20.0) is not None
    _store_outcomes(pg_store, spec, range(0, 10), {5})
    _store_outcomes(pg_store, spec, range(12, 20), set())  # 10 and 11 missing: a gap
    cursor = first.write(batches.get(batch_id) or {}, plan, ids, Cursor(), None)
    row = batches.get(batch_id) or {}
    # Lines 0..6 hold items 0..9 (lines 0, 3, 6 two each); line 7 (item 10) waits for the gap.
    assert (cursor.line, cursor.items, row["completed"], row["failed"]) == (7, {"noop": 10}, 6, 1)
    assert Cursor.of(row) == cursor

    # Its lease runs out and another process takes the batch: the first writes nothing more.
    batches.release(batch_id, "first")
    assert batches.claim(batch_id, "second", 20.0) is not None
    _store_outcomes(pg_store, spec, range(10, 12), set())
    with pytest.raises(LeaseLost):
        first.write(batches.get(batch_id) or {}, plan, ids, cursor, None)
    second = OutputWriter(files, batches, "second", 20.0)
    row = batches.get(batch_id) or {}
    cursor = second.write(row, plan, ids, Cursor.of(row), None, missing="cancelled")
    assert (cursor.line, cursor.completed, cursor.failed) == (30, 14, 16)

    output = [orjson.loads(line) for line in b"".join(files.content(ids[0])).splitlines()]
    errors = [orjson.loads(line) for line in b"".join(files.content(ids[1])).splitlines()]
    assert len(b"".join(files.content(ids[0]))) == cursor.output_bytes
    written = sorted([*output, *errors], key=lambda line: int(line["custom_id"][1:]))
    assert [line["custom_id"] for line in written] == [f"c{i}" for i in range(30)]
    assert [line["custom_id"] for line in output] == sorted(
        (line["custom_id"] for line in output), key=lambda name: int(name[1:])
    )
    codes = {line["custom_id"]: (line["error"] or {}).get("code") for line in errors}
    assert codes["c3"] is None  # item 5 (line 3) failed in the model: a 500 answer, not a missing one
    assert sum(code == "batch_cancelled" for code in codes.values()) == 15  # items 20..39 never stored


def test_an_expired_file_is_gone_and_its_bytes_swept(pg_store: ResultStore) -> None:
    files = FileStore(pg_store.engine, pg_store.url)
    now = utcnow()
    old, new, kept = (f"file-{uuid.uuid4().hex}" for _ in range(3))
    files.create(
        FileRecord(old, "t", "o.jsonl", "batch_output", 0, now, now - timedelta(seconds=1)), [b"o\n"]
    )
    files.create(FileRecord(new, "t", "n.jsonl", "batch_output", 0, now, now + timedelta(hours=1)), [b"n\n"])
    files.create(FileRecord(kept, "t", "k.jsonl", "batch", 0, now), [b"k\n"])
    assert files.get(old, ["t"]) is None
    assert (files.get(new, ["t"]) or FileRecord("", "", "", "", 0, now)).expires_at is not None
    assert sorted(record.id for record in files.page(["t"], None, None, 10, True).rows) == sorted([new, kept])
    assert files.sweep_expired() == 1
    assert list(files.content(old)) == []
    assert b"".join(files.content(new)) == b"n\n" and b"".join(files.content(kept)) == b"k\n"


def test_a_listing_goes_on_after_an_expired_file_and_refuses_a_deleted_or_foreign_one(
    pg_store: ResultStore,
) -> None:
    files, batches = FileStore(pg_store.engine, pg_store.url), BatchStore(pg_store.engine, pg_store.url)
    now = utcnow()
    ids = [f"file-{uuid.uuid4().hex}" for _ in range(4)]
    for age, file_id in enumerate(ids):  # ids[0] the newest
        created, expires = now - timedelta(seconds=age), now - timedelta(seconds=1) if age == 1 else None
        files.create(FileRecord(file_id, "t", "f.jsonl", "batch", 0, created, expires), [])
    foreign = f"file-{uuid.uuid4().hex}"
    files.create(FileRecord(foreign, "u", "f.jsonl", "batch", 0, now), [])

    def listed(after: str | None) -> list[str]:
        return [record.id for record in files.page(["t"], None, after, 10, True).rows]

    assert listed(None) == [ids[0], ids[2], ids[3]]  # ids[1] has expired
    assert listed(ids[1]) == [ids[2], ids[3]]  # a listing that stopped at it goes on
    assert files.delete(ids[2], ["t"])
    for gone in (ids[2], foreign, "file-never"):  # read from the first page again, a client would loop
        with pytest.raises(InvalidInput, match=f"^after: '{gone}' is none of yours to list from"):
            listed(gone)
    with pytest.raises(InvalidInput, match="^after: 'batch_never'"):
        batches.page(["t"], "batch_never", 10)
