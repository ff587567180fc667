"""`batchwork run` on the embedded default: no broker, an in-process worker, a SQLite file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.processes import ROOT, batchwork

EXAMPLE = ROOT / "examples" / "docs.jsonl"


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_run_writes_every_result_in_input_order(tmp_path: Path) -> None:
    done = batchwork(tmp_path, "run", str(EXAMPLE), "--model", "noop", "-o", "out.jsonl")
    assert done.returncode == 0, done.stderr
    out = read_lines(tmp_path / "out.jsonl")
    ids = [json.loads(line)["id"] for line in EXAMPLE.read_text().splitlines()]
    assert [(r["index"], r["id"]) for r in out] == list(enumerate(ids))
    assert all(r["output"] == 0 for r in out)
    assert "items/s" in done.stderr
    assert (tmp_path / "batchwork.db").exists()  # the default database, created on first use


@pytest.mark.slow
def test_run_minilm_gives_unit_384d_embeddings(tmp_path: Path) -> None:
    done = batchwork(tmp_path, "run", str(EXAMPLE), "--model", "minilm", "-o", "out.jsonl")
    assert done.returncode == 0, done.stderr
    out = read_lines(tmp_path / "out.jsonl")
    assert len(out) == 20
    for line in out:
        vector = line["output"]
        assert len(vector) == 384
        assert abs(sum(x * x for x in vector) - 1) < 1e-4


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"text": "fine"}\n{not json}\n', "line 2, column 2: not valid JSON"),
        # Latin-1, not UTF-8: the column is the bad byte's own, not orjson's column 1.
        (
            b'{"text": "fine"}\n{"id": 1, "text": "caf\xe9 au lait"}\n',
            "line 2, column 23: not UTF-8 (byte 0xe9",
        ),
        ('{"text": "d\u00e9j\u00e0"}\n{"text": "d\u00e9j\u00e0" x}\n', "line 2, column 17: not valid JSON"),
        ('{"text": "fine"}\n\n{"id": 3}\n', "line 3: missing field 'text'"),
        ('{"text": 5}\n', "line 1: field 'text' must be a string"),
        ("\n\n", "no inputs"),
    ],
)
def test_a_bad_file_is_refused_with_its_line_and_no_traceback(
    tmp_path: Path, content: str | bytes, message: str
) -> None:
    (tmp_path / "in.jsonl").write_bytes(content if isinstance(content, bytes) else content.encode())
    done = batchwork(tmp_path, "run", "in.jsonl", "--model", "noop", timeout_s=60)
    assert done.returncode == 2
    assert message in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "batchwork.db").exists()  # refused before anything was created


def test_an_unknown_model_is_refused(tmp_path: Path) -> None:
    done = batchwork(tmp_path, "run", str(EXAMPLE), "--model", "nope", timeout_s=60)
    assert done.returncode == 2
    assert "unknown model" in done.stderr and "minilm" in done.stderr
    assert "Traceback" not in done.stderr
