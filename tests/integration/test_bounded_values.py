"""Values the database refuses never reach it (issue 17, class 1), on SQLite and PostgreSQL alike: ids, texts,
JSON and integers are bounded by worker/bounds.py at the client, the API and the store; what a model outputs
that the database then refuses becomes one stored line, never an SQL dump; the API answers any path or query
value in one line, never a 500, and its OpenAPI document states the bounds."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from api.app import create_app
from tests.integration.runtime.test_storer import FakeOutbox, held, record
from worker.bounds import MAX_COUNT
from worker.client import Client
from worker.errors import InvalidInput, JobNotFound
from worker.runtime.deliveries import Holdings, ResultsToStore
from worker.runtime.forward import error_text
from worker.runtime.store_thread import Storer
from worker.settings import Settings
from worker.store import tables
from worker.store.api_keys import KeyStore
from worker.store.results import ResultStore
from worker.store.values import ItemRecord, JobSpec

UNSTORABLE_TEXTS = ["\x00", "a\x00b", "\ud800", "x\udfff", "\udc80\x00", "ok" * 50 + "\x00"]
NOT_JOB_IDS = [
    "x",
    "x\x00",
    "\x00" * 36,
    "\ud800",
    "' OR 1=1 --",
    "9" * 400,
    str(uuid.UUID(int=7)).upper(),
    uuid.UUID(int=7).hex,
    f" {uuid.UUID(int=7)}",
    f"{uuid.UUID(int=7)}\n",
    "%00",
    "",
]
BAD_METADATA: list[Any] = [
    {"k": "\x00"},
    {"\x00": 1},
    {"k": ["fine", {"deep": "\ud83d"}]},
    {"n": 2**64},
    {"n": -(2**63) - 1},
]


@pytest.fixture
def store(db_url: str) -> Iterator[ResultStore]:
    store = ResultStore.from_url(db_url)
    try:
        yield store
    finally:
        store.close()


def _jobs_rows(store: ResultStore) -> int:
    with store.engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(tables.jobs)).scalar_one())


@pytest.mark.parametrize("text", UNSTORABLE_TEXTS)
def test_an_item_id_the_database_cannot_keep_is_refused_at_submit(
    db_url: str, store: ResultStore, text: str
) -> None:
    client = Client(Settings(database_url=db_url))
    with pytest.raises(InvalidInput) as refused:
        client.submit("noop", ["fine", {"id": text, "text": "t"}])
    assert str(refused.value).startswith("item 1: field 'id' holds a") and "\n" not in str(refused.value)
    assert _jobs_rows(store) == 0


@pytest.mark.parametrize("metadata", BAD_METADATA)
def test_metadata_the_database_cannot_keep_is_refused_before_the_job_is_recorded(
    db_url: str, store: ResultStore, metadata: Any
) -> None:
    client = Client(Settings(database_url=db_url))
    with pytest.raises(InvalidInput, match="^metadata|^a key of metadata"):
        client.submit("noop", ["fine"], metadata=metadata)
    assert _jobs_rows(store) == 0


@pytest.mark.parametrize("job_id", NOT_JOB_IDS)
def test_a_string_that_is_no_job_id_names_no_job_anywhere(
    db_url: str, store: ResultStore, job_id: str
) -> None:
    client = Client(Settings(database_url=db_url))
    for read in (client.status, lambda j: list(client.results(j)), client.cancel):
        with pytest.raises(JobNotFound) as missing:
            read(job_id)
        assert "\n" not in str(missing.value).replace(repr(job_id), "")
    # The store itself never sends one to the database: no job, no results, nothing cancelled.
    assert store.status(job_id) is None and store.status(job_id, ["acme"]) is None
    assert list(store.results(job_id)) == [] and store.cancel(job_id) is False
    assert store.recent_batches(job_id) == []


@pytest.mark.parametrize("after", [-(2**63), -2, MAX_COUNT + 1, 2**63, 10**30])
def test_an_index_beyond_the_column_reads_nothing(store: ResultStore, after: int) -> None:
    job = JobSpec(str(uuid.uuid4()), "noop", "normal", 1)
    store.create_job(job)
    assert list(store.results(job.job_id, after=after)) == []


def test_what_the_database_refuses_of_an_output_is_one_stored_line(store: ResultStore) -> None:
    outputs: list[Any] = ["fine", "nul \x00 inside", "\ud800", 2**70, {"k\x00": 1}, [1.5, None]]
    # An item's error as the runner makes it from a model's exception that repeats its input.
    errors = [None, None, None, None, None, error_text(ValueError("text 'a\x00b\ud800' refused"))]
    job = JobSpec(str(uuid.uuid4()), "noop", "normal", len(outputs))
    delivery = held(job, len(outputs))
    write = ResultsToStore(record(len(outputs)))
    for index, (output, error) in enumerate(zip(outputs, errors, strict=True)):
        outcome = ItemRecord(job.job_id, index, f"id-{index}", output=None if error else output, error=error)
        write.add(outcome, delivery)
    outbox = FakeOutbox()
    storer = Storer(store, outbox, Holdings())  # type: ignore[arg-type]
    thread = threading.Thread(target=storer.loop)
    thread.start()
    storer.work.put(write)
    storer.work.put(None)
    thread.join(60)
    assert not thread.is_alive(), "the store thread wedged"
    stored = {row.index: row for row in store.results(job.job_id)}
    assert sorted(stored) == list(range(len(outputs))), "every item has its one outcome"
    assert stored[0].output == "fine" and stored[0].item_id == "id-0"
    for row in stored.values():
        if row.error is not None:
            assert "\n" not in row.error and "[SQL" not in row.error and "\x00" not in row.error
            assert len(row.error) < 600
    # A value no JSON encoder writes fails alone on both stores; an integer beyond 64 bits too.
    for index in (2, 3):
        assert (stored[index].error or "").startswith("could not store the output: ")
    assert stored[5].error == "ValueError: text 'a\\x00b\\ud800' refused"  # alike on both stores
    status = store.status(job.job_id)
    assert status is not None and status.done + status.failed == len(outputs)
    assert [d for s in outbox.settled for d in s.deliveries] == [delivery]


@pytest.fixture
def api(db_url: str) -> Iterator[tuple[TestClient, str, str]]:
    settings = Settings(database_url=db_url, api_check_processes=0)
    _record, key = KeyStore(ResultStore.from_url(db_url).engine).create("acme")
    with TestClient(create_app(settings), raise_server_exceptions=False) as http:
        http.headers["Authorization"] = f"Bearer {key}"
        yield http, key, db_url


def _one_line(answer: Any, *statuses: int) -> None:
    assert answer.status_code in statuses, (answer.status_code, answer.text[:300])
    detail = answer.json()["detail"]
    assert isinstance(detail, str) and "\n" not in detail and "Traceback" not in detail


@pytest.mark.parametrize(
    "path",
    ["x", "x%00", "%00" * 36, "%ED%A0%80", "%27%20OR%201%3D1%20--", "9" * 400, str(uuid.UUID(int=7)).upper()],
)
def test_any_job_id_in_a_path_is_404_in_one_line(api: tuple[TestClient, str, str], path: str) -> None:
    http, _key, _url = api
    for method, route in (("GET", ""), ("GET", "/results"), ("POST", "/cancel")):
        _one_line(http.request(method, f"/v1/jobs/{path}{route}"), 404)
    http.cookies.set("batchwork_key", _key)
    assert http.get(f"/ui/jobs/{path}").status_code == 404


@pytest.mark.parametrize(
    "query",
    [
        "after=2147483648",
        "after=-2",
        "after=9223372036854775808",
        "limit=99999999999999999999",
        "limit=0",
        "limit=-1",
        "after=1e3",
        "after=%00",
        "limit=nan",
    ],
)
def test_any_results_query_beyond_its_bounds_is_422_before_the_first_byte(
    api: tuple[TestClient, str, str], query: str
) -> None:
    http, _key, db_url = api
    spec = JobSpec(str(uuid.uuid4()), "noop", "normal", 3)
    ResultStore.from_url(db_url).create_job(spec, tenant="acme")
    _one_line(http.get(f"/v1/jobs/{spec.job_id}/results?{query}"), 422)


def test_results_at_the_bounds_stream_whole(api: tuple[TestClient, str, str]) -> None:
    http, _key, db_url = api
    store = ResultStore.from_url(db_url)
    spec = JobSpec(str(uuid.uuid4()), "noop", "normal", 3)
    store.create_job(spec, tenant="acme")
    store.write_batch(None, [ItemRecord(spec.job_id, i, None, output=i) for i in range(3)], [spec])
    for query, lines in (
        (f"after={MAX_COUNT}", 0),
        ("after=-1", 3),
        (f"limit={MAX_COUNT}", 3),
        ("after=0&limit=1", 1),
    ):
        answer = http.get(f"/v1/jobs/{spec.job_id}/results?{query}")
        assert answer.status_code == 200 and len(answer.text.splitlines()) == lines, query


@pytest.mark.parametrize(
    "query",
    ["limit=501", "limit=0", "limit=99999999999999999999", "cursor=" + "A" * 300, "cursor=%00", "state=x"],
)
def test_any_listing_query_beyond_its_bounds_is_422(api: tuple[TestClient, str, str], query: str) -> None:
    http, _key, _url = api
    _one_line(http.get(f"/v1/jobs?{query}"), 422)


def test_a_forged_cursor_naming_a_nul_job_is_422(api: tuple[TestClient, str, str]) -> None:
    import base64

    import orjson

    http, _key, _url = api
    for job_id in ("\x00", "x", "y" * 36, "0" * 8 + "-0000-0000-0000-" + "\x00" * 12):
        raw = orjson.dumps(["2026-01-01T00:00:00+00:00", job_id])
        cursor = base64.urlsafe_b64encode(raw).decode().rstrip("=")
        _one_line(http.get(f"/v1/jobs?cursor={cursor}"), 422)


@pytest.mark.parametrize(
    "body",
    [
        {"model": "noop", "inputs": [{"id": "a\u0000b", "text": "t"}]},
        {"model": "noop", "inputs": ["t"], "metadata": {"k": "\u0000"}},
        {"model": "noop", "inputs": ["t"], "metadata": {"n": 2**64}},
        {"model": "no\u0000pe", "inputs": ["t"]},
        {"model": "noop", "inputs": ["t"], "priority": "\u0000"},
    ],
)
def test_a_submit_carrying_what_the_database_refuses_is_422_and_records_nothing(
    api: tuple[TestClient, str, str], body: dict[str, Any]
) -> None:
    http, _key, db_url = api
    _one_line(http.post("/v1/jobs", json=body), 422)
    assert _jobs_rows(ResultStore.from_url(db_url)) == 0


def test_the_openapi_document_states_the_bounds(api: tuple[TestClient, str, str]) -> None:
    http, _key, _url = api
    document = http.get("/openapi.json").json()
    results = document["paths"]["/v1/jobs/{job_id}/results"]["get"]["parameters"]
    schema = {p["name"]: p["schema"] for p in results}
    assert schema["job_id"]["format"] == "uuid"
    after, limit = schema["after"], schema["limit"]["anyOf"][0]
    assert (after["minimum"], after["maximum"]) == (-1, MAX_COUNT)
    assert (limit["minimum"], limit["maximum"]) == (1, MAX_COUNT)
    listing = {p["name"]: p["schema"] for p in document["paths"]["/v1/jobs"]["get"]["parameters"]}
    assert listing["limit"]["maximum"] == 500 and listing["cursor"]["anyOf"][0]["maxLength"] == 200
