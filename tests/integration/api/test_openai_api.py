"""The OpenAI-compatible surface through the official `openai` client: /v1/files, /v1/batches and
/v1/embeddings on a real `batchwork api` and real workers on Redis and PostgreSQL.

Batches: upload, create, poll, download output and error files, list, cancel; a file mixing two models; a
malformed file failing at validation with its lines named and nothing enqueued; a worker and then the API
SIGKILLed in the middle of a 2,000-line batch: every custom_id exactly once. Embeddings: float, base64,
dimensions, token arrays, the same vectors as a batchwork job.
"""

from __future__ import annotations

import base64
import io
import json
import math
import signal
from typing import Any

import numpy as np
import openai
import orjson
import pytest
from sqlalchemy import func, select

from tests.integration.api_server import ApiProcess, api_server, make_key, wait_until
from tests.integration.processes import TEST_MODELS, WorkerProcess, service_env, workers
from worker.store import tables
from worker.store.results import ResultStore

SLOW = "tests.support.models:SlowEmbed"
CHAT = "tests.support.models:ChatEcho"
FINISHED = {"completed", "failed", "expired", "cancelled"}


@pytest.fixture
def env(redis_url: str, pg_url: str, pg_store: ResultStore) -> dict[str, str]:
    return service_env(
        redis_url, pg_url, metrics_port=0, models=[*TEST_MODELS, SLOW, CHAT], visibility_timeout_s=4
    )


def client_for(api: ApiProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{api.url}/v1", api_key=key, max_retries=0, timeout=60)


def jsonl(lines: list[Any]) -> bytes:
    return b"".join((line if isinstance(line, bytes) else orjson.dumps(line)) + b"\n" for line in lines)


def upload(client: openai.OpenAI, lines: list[Any]) -> str:
    return client.files.create(file=("batch.jsonl", io.BytesIO(jsonl(lines))), purpose="batch").id


def embedding_line(custom_id: str, model: str, text: Any, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/embeddings",
        "body": {"model": model, "input": text, **body},
    }


def wait_batch(client: openai.OpenAI, batch_id: str, timeout_s: float = 120) -> Any:
    def finished() -> Any:
        batch = client.batches.retrieve(batch_id)
        return batch if batch.status in FINISHED else None

    return wait_until(finished, timeout_s, lambda: f"batch {batch_id} unfinished", poll_s=0.2)


def read_lines(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).content.splitlines()]


@pytest.mark.slow
def test_a_batch_mixing_two_models_completes_with_output_and_error_files_in_input_order(
    env: dict[str, str],
) -> None:
    key = make_key(env["BATCHWORK_DATABASE_URL"], "alice")
    lines = []
    for i in range(60):
        if i % 3 == 0:
            lines.append(embedding_line(f"m-{i}", "minilm", f"sentence number {i} about batching"))
        elif i % 3 == 1:
            lines.append(embedding_line(f"n-{i}", "noop", [f"a {i}", f"b {i}"]))
        else:
            lines.append(
                embedding_line(f"d-{i}", "minilm", f"short {i}", dimensions=8, encoding_format="base64")
            )
    lines.append(embedding_line("too-wide", "noop", "x", dimensions=2))  # noop's vector has 1 number
    with workers(env), api_server(env) as api:
        client = client_for(api, key)
        file_id = upload(client, lines)
        uploaded = client.files.retrieve(file_id)
        assert (uploaded.purpose, uploaded.filename, uploaded.bytes) == (
            "batch",
            "batch.jsonl",
            len(jsonl(lines)),
        )
        assert client.files.content(file_id).content == jsonl(lines)

        with pytest.raises(openai.UnprocessableEntityError):  # OpenAI's bounds: 1 hour to 30 days
            client.batches.create(
                input_file_id=file_id,
                endpoint="/v1/embeddings",
                completion_window="24h",
                output_expires_after={"anchor": "created_at", "seconds": 60},
            )
        batch = client.batches.create(
            input_file_id=file_id,
            endpoint="/v1/embeddings",
            completion_window="24h",
            metadata={"run": "t1"},
            output_expires_after={"anchor": "created_at", "seconds": 7200},
        )
        assert batch.status in {"validating", "in_progress", "finalizing", "completed"}
        assert batch.metadata == {"run": "t1"}
        done = wait_batch(client, batch.id)
        assert done.status == "completed", done
        assert done.request_counts is not None
        assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (
            61,
            60,
            1,
        )
        assert done.in_progress_at and done.finalizing_at and done.completed_at and done.expires_at
        for written_id in (done.output_file_id, done.error_file_id):
            written = client.files.retrieve(written_id or "")
            assert written.expires_at == written.created_at + 7200

        output = read_lines(client, done.output_file_id)
        assert [line["custom_id"] for line in output] == [line["custom_id"] for line in lines[:60]]
        reference = client.embeddings.create(model="minilm", input="sentence number 0 about batching")
        for line in output:
            assert line["error"] is None and line["response"]["status_code"] == 200
            body = line["response"]["body"]
            assert body["object"] == "list" and body["model"] in {"minilm", "noop"}
            if line["custom_id"].startswith("m-"):
                vector = body["data"][0]["embedding"]
                assert len(vector) == 384 and math.isclose(np.linalg.norm(vector), 1.0, rel_tol=1e-4)
                assert body["usage"]["prompt_tokens"] > 0
            elif line["custom_id"].startswith("n-"):
                assert [d["embedding"] for d in body["data"]] == [[0.0], [0.0]]
                assert [d["index"] for d in body["data"]] == [0, 1]
            else:
                vector = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
                assert vector.shape == (8,) and math.isclose(float(np.linalg.norm(vector)), 1.0, rel_tol=1e-4)
        first = output[0]["response"]["body"]["data"][0]["embedding"]
        assert np.allclose(first, reference.data[0].embedding, atol=1e-5)

        errors = read_lines(client, done.error_file_id)
        assert [line["custom_id"] for line in errors] == ["too-wide"]
        assert errors[0]["response"]["status_code"] == 400
        assert "dimensions" in errors[0]["response"]["body"]["error"]["message"]

        listed = client.batches.list(limit=10)
        assert [b.id for b in listed.data] == [batch.id]
        files = {f.id: f.purpose for f in client.files.list()}
        assert files == {
            file_id: "batch",
            done.output_file_id: "batch_output",
            done.error_file_id: "batch_output",
        }
        assert client.files.delete(file_id).deleted
        with pytest.raises(openai.NotFoundError):
            client.files.retrieve(file_id)


@pytest.mark.slow
def test_a_malformed_file_fails_at_validation_naming_each_line_and_enqueues_nothing(
    env: dict[str, str], pg_store: ResultStore
) -> None:
    key = make_key(env["BATCHWORK_DATABASE_URL"], "bob")
    lines = [
        embedding_line("ok-1", "noop", "fine"),
        b'{"custom_id": "broken", ',
        embedding_line("ok-1", "noop", "a repeated custom_id"),
        {**embedding_line("wrong-url", "noop", "x"), "url": "/v1/completions"},
        embedding_line("unknown-model", "no-such-model", "x"),
        embedding_line("wrong-kind", "gpt2", "gpt2 generates, it does not embed"),
        embedding_line("empty", "minilm", ""),
        {"method": "POST", "url": "/v1/embeddings", "body": {"model": "noop", "input": "no custom_id"}},
    ]
    with api_server(env) as api:  # no worker: nothing may be enqueued anyway
        client = client_for(api, key)
        batch = client.batches.create(
            input_file_id=upload(client, lines), endpoint="/v1/embeddings", completion_window="24h"
        )
        failed = wait_batch(client, batch.id, 30)
    assert failed.status == "failed" and failed.failed_at
    assert failed.errors is not None and failed.errors.data is not None
    found = {error.line: (error.code, error.message) for error in failed.errors.data}
    assert sorted(found) == [2, 3, 4, 5, 6, 7, 8]
    assert found[2][0] == "invalid_json"
    assert found[3][0] == "duplicate_custom_id"
    assert found[4][0] == "mismatched_url"
    assert found[5][0] == "model_not_found"
    assert found[6][0] == "model_not_supported"
    assert "empty" in found[7][1]
    assert found[8][0] == "missing_required_parameter"
    assert failed.output_file_id is None and failed.error_file_id is None
    with pg_store.engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(tables.jobs)).scalar_one() == 0


@pytest.mark.slow
def test_cancel_moves_through_cancelling_to_cancelled_and_keeps_the_finished_lines(
    env: dict[str, str],
) -> None:
    key = make_key(env["BATCHWORK_DATABASE_URL"], "carol")
    lines = [embedding_line(f"c-{i}", SLOW, f"text {i}") for i in range(3000)]
    with workers(env), api_server(env) as api:
        client = client_for(api, key)
        batch = client.batches.create(
            input_file_id=upload(client, lines), endpoint="/v1/embeddings", completion_window="24h"
        )
        wait_until(
            lambda: (
                (b := client.batches.retrieve(batch.id)).status == "in_progress"
                and b.request_counts is not None
                and b.request_counts.completed > 0
            ),
            60,
            lambda: "the batch never made progress",
            poll_s=0.05,
        )
        cancelling = client.batches.cancel(batch.id)
        assert cancelling.status in {"cancelling", "cancelled"}
        done = wait_batch(client, batch.id, 60)
        assert done.status == "cancelled" and done.cancelling_at and done.cancelled_at
        output = read_lines(client, done.output_file_id)
        errors = read_lines(client, done.error_file_id)
    ids = [line["custom_id"] for line in output] + [line["custom_id"] for line in errors]
    assert sorted(ids) == sorted(line["custom_id"] for line in lines)
    assert output and errors
    assert {line["error"]["code"] for line in errors} == {"batch_cancelled"}
    assert done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (len(output), len(errors))


@pytest.mark.slow
def test_embeddings_float_base64_dimensions_and_token_arrays(env: dict[str, str]) -> None:
    key = make_key(env["BATCHWORK_DATABASE_URL"], "dave")
    texts = ["The cat sat on the mat.", "Batch inference on a GPU"]
    with workers(env), api_server(env) as api:
        client = client_for(api, key)
        floats = client.embeddings.create(model="minilm", input=texts, encoding_format="float")
        packed = client.embeddings.create(model="minilm", input=texts)  # the client asks for base64
        short = client.embeddings.create(model="minilm", input=texts[0], dimensions=32)
        from tokenizers import Tokenizer

        from worker.models.minilm import MiniLM
        from worker.openai_compat.tokens import tokenizer_dir

        directory = tokenizer_dir(MiniLM)
        assert directory is not None
        ids = (
            Tokenizer.from_file(str(directory / "tokenizer.json"))
            .encode(texts[0], add_special_tokens=False)
            .ids
        )
        tokens = client.embeddings.create(model="minilm", input=[ids], encoding_format="float")
        noop = client.embeddings.create(model="noop", input="x", encoding_format="float")
        with pytest.raises(openai.UnprocessableEntityError):
            client.embeddings.create(model="gpt2", input="x")
        with pytest.raises(openai.UnprocessableEntityError):
            client.embeddings.create(model="minilm", input="x", dimensions=1000)
    full = [np.array(d.embedding) for d in floats.data]
    assert [d.index for d in floats.data] == [0, 1] and all(v.shape == (384,) for v in full)
    assert all(math.isclose(float(np.linalg.norm(v)), 1.0, rel_tol=1e-4) for v in full)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > 4
    for a, b in zip(floats.data, packed.data, strict=True):
        assert np.allclose(a.embedding, b.embedding, atol=1e-7)
    cut = full[0][:32] / np.linalg.norm(full[0][:32])
    assert np.allclose(short.data[0].embedding, cut, atol=1e-5)
    assert np.allclose(tokens.data[0].embedding, full[0], atol=1e-4)
    assert noop.data[0].embedding == [0.0]


@pytest.mark.slow
def test_chat_and_completions_batches_answer_as_openai_does(env: dict[str, str]) -> None:
    key = make_key(env["BATCHWORK_DATABASE_URL"], "erin")
    chat = [
        {
            "custom_id": f"chat-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": CHAT, "messages": [{"role": "user", "content": f"hello {i}"}], "max_tokens": 5},
        }
        for i in range(5)
    ] + [
        {
            "custom_id": "noop-chat",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "noop", "messages": [{"role": "user", "content": "hi"}]},
        }
    ]
    with workers(env), api_server(env) as api:
        client = client_for(api, key)
        batch = client.batches.create(
            input_file_id=upload(client, chat), endpoint="/v1/chat/completions", completion_window="24h"
        )
        done = wait_batch(client, batch.id)
        assert done.status == "completed", done
        output = read_lines(client, done.output_file_id)
    assert [line["custom_id"] for line in output] == [line["custom_id"] for line in chat]
    body = output[1]["response"]["body"]
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "1 oll", "refusal": None}
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}
    assert output[-1]["response"]["body"]["choices"][0]["message"]["content"] == ""


@pytest.mark.slow
def test_another_tenant_sees_no_file_and_no_batch(env: dict[str, str]) -> None:
    alice = make_key(env["BATCHWORK_DATABASE_URL"], "alice")
    mallory = make_key(env["BATCHWORK_DATABASE_URL"], "mallory")
    with api_server(env) as api:
        mine = client_for(api, alice)
        theirs = client_for(api, mallory)
        file_id = upload(mine, [embedding_line("a", "noop", "x")])
        batch = mine.batches.create(input_file_id=file_id, endpoint="/v1/embeddings", completion_window="24h")
        for call in (
            lambda: theirs.files.retrieve(file_id),
            lambda: theirs.files.content(file_id),
            lambda: theirs.files.delete(file_id),
            lambda: theirs.batches.retrieve(batch.id),
            lambda: theirs.batches.cancel(batch.id),
            lambda: theirs.batches.create(
                input_file_id=file_id, endpoint="/v1/embeddings", completion_window="24h"
            ),
        ):
            with pytest.raises(openai.NotFoundError):
                call()
        assert theirs.batches.list().data == [] and theirs.files.list().data == []


@pytest.fixture
def small_files(env: dict[str, str]) -> dict[str, str]:
    return {**env, "BATCHWORK_API_MAX_FILE_BYTES": "1024"}


@pytest.mark.slow
def test_a_file_over_the_limit_is_413(small_files: dict[str, str]) -> None:
    key = make_key(small_files["BATCHWORK_DATABASE_URL"], "alice")
    with api_server(small_files) as api:
        client = client_for(api, key)
        with pytest.raises(openai.APIStatusError) as too_large:
            client.files.create(file=("big.jsonl", io.BytesIO(b"x" * 4096)), purpose="batch")
        assert too_large.value.status_code == 413
        client.files.create(file=("small.jsonl", io.BytesIO(b"x" * 1000)), purpose="batch")


def _kill(process: Any) -> None:
    process.proc.send_signal(signal.SIGKILL)
    process.proc.wait(10)
    process.stop()  # its log pipe closed, what it left in its group gone


@pytest.mark.slow
def test_a_batch_finishes_every_line_once_when_a_worker_and_the_api_are_sigkilled(
    env: dict[str, str],
) -> None:
    key = make_key(env["BATCHWORK_DATABASE_URL"], "frank")
    lines = [embedding_line(f"k-{i}", SLOW, f"{chr(65 + i % 26)}{'x' * (i % 50)}") for i in range(2000)]
    worker = WorkerProcess(env, "w-killed@test")
    api = ApiProcess(env)
    try:
        worker.wait_ready()
        api.wait_healthy()
        client = client_for(api, key)
        batch = client.batches.create(
            input_file_id=upload(client, lines), endpoint="/v1/embeddings", completion_window="24h"
        )

        def progressed(at_least: int) -> bool:
            counts = client.batches.retrieve(batch.id).request_counts
            return counts is not None and counts.completed >= at_least

        wait_until(lambda: progressed(200), 60, lambda: "no progress before the kill", poll_s=0.05)
        _kill(worker)
        _kill(api)
        worker = WorkerProcess(env, "w-restarted@test")
        api = ApiProcess(env)
        worker.wait_ready()
        api.wait_healthy()
        client = client_for(api, key)
        done = wait_batch(client, batch.id, 180)
        assert done.status == "completed", done
        output = read_lines(client, done.output_file_id)
    finally:
        worker.stop()
        api.stop()
    assert [line["custom_id"] for line in output] == [line["custom_id"] for line in lines]
    for line, sent in zip(output, lines, strict=True):
        text = sent["body"]["input"]
        assert line["response"]["body"]["data"][0]["embedding"] == [
            float(len(text)),
            1.0,
            float(ord(text[0])),
        ]
    assert done.error_file_id is None
