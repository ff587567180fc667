"""`batchwork run FILE` with no --model on an OpenAI batch file: OpenAI batch output in input order, failed
requests in --errors, a bad file refused with its line before anything runs (the embedded default)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.integration.processes import batchwork


def _line(custom_id: str, model: str, text: object, **body: object) -> str:
    request = {"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings"}
    return json.dumps({**request, "body": {"model": model, "input": text, **body}})


def test_an_openai_batch_file_runs_each_line_on_its_model(tmp_path: Path) -> None:
    lines = [_line(f"r{i}", "minilm" if i % 2 else "noop", f"text {i}") for i in range(12)]
    lines.insert(5, _line("too-wide", "noop", "x", dimensions=3))
    (tmp_path / "batch.jsonl").write_text("\n".join(lines) + "\n")
    done = batchwork(tmp_path, "run", "batch.jsonl", "-o", "out.jsonl", "--errors", "errors.jsonl")
    assert done.returncode == 1, done.stderr  # one request failed
    assert "Traceback" not in done.stderr
    out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    errors = [json.loads(line) for line in (tmp_path / "errors.jsonl").read_text().splitlines()]
    assert [line["custom_id"] for line in out] == [f"r{i}" for i in range(12)]
    for line in out:
        assert line["error"] is None and line["response"]["status_code"] == 200
        vector = line["response"]["body"]["data"][0]["embedding"]
        assert len(vector) == (384 if line["response"]["body"]["model"] == "minilm" else 1)
    assert [line["custom_id"] for line in errors] == ["too-wide"]
    assert errors[0]["response"]["status_code"] == 400


def test_a_bad_openai_batch_file_names_its_lines_and_runs_nothing(tmp_path: Path) -> None:
    lines = [_line("a", "noop", "x"), "{oops", _line("a", "noop", "again"), _line("b", "gpt2", "x")]
    (tmp_path / "batch.jsonl").write_text("\n".join(lines) + "\n")
    done = batchwork(tmp_path, "run", "batch.jsonl", "-o", "out.jsonl", timeout_s=60)
    assert done.returncode == 2
    assert "3 bad line(s), nothing ran: line 2: not valid JSON" in done.stderr
    assert "line 3: custom_id 'a' appears twice" in done.stderr and "line 4: model 'gpt2'" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "out.jsonl").exists() and not (tmp_path / "batchwork.db").exists()


def test_a_plain_file_without_a_model_asks_for_one(tmp_path: Path) -> None:
    (tmp_path / "in.jsonl").write_text('{"text": "hello"}\n')
    done = batchwork(tmp_path, "run", "in.jsonl", timeout_s=60)
    assert done.returncode == 2
    assert "give --model NAME" in done.stderr and "Traceback" not in done.stderr
