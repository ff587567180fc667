"""The streams `batchwork run` is made of: input lines, results handed on in order as they arrive, and an
output file that a killed run's successor continues."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from worker.cli.running import InOrder, RunState
from worker.jsonl import ResultFile, input_lines
from worker.store.values import ItemRecord


class Rows:
    """A job's stored rows as the store reads them (index order, ``after``/``before``), counting reads."""

    def __init__(self) -> None:
        self.stored: dict[int, ItemRecord] = {}
        self.read = 0

    def results(self, job_id: str, after: int = -1, before: int | None = None) -> Iterator[ItemRecord]:
        for index in sorted(self.stored):
            if index > after and (before is None or index < before):
                self.read += 1
                yield self.stored[index]


def test_results_are_handed_on_in_order_once_however_they_arrive() -> None:
    rows, total = Rows(), 5000
    order = list(range(total))
    random.Random(7).shuffle(order)
    ordered = InOrder(rows, "job", 0)
    written: list[int] = []
    for start in range(0, total, 250):
        for index in order[start : start + 250]:
            rows.stored[index] = ItemRecord("job", index, f"d{index}", output=index)
        written += [json.loads(line)["index"] for line in ordered.poll(until=float("inf"))]
    assert written == list(range(total))
    assert rows.read <= 3 * total  # each row is read once by a scan, at most once more by a gap fill


def test_a_resumed_file_keeps_its_complete_lines_and_drops_a_torn_one(tmp_path: Path) -> None:
    out = ResultFile(tmp_path / "out.jsonl")
    assert out.open(resume=True) == 0  # nothing to continue
    for index in range(3):
        out.write(b'{"index":%d,"id":null,"output":0}\n' % index)
    out.write(b'{"index":3,"id":nu')  # killed mid-line
    assert out._out is not None
    out._out.close()

    again = ResultFile(tmp_path / "out.jsonl")
    assert again.open(resume=True) == 3
    again.write(b'{"index":3,"id":null,"output":0}\n')
    again.finish()
    lines = (tmp_path / "out.jsonl").read_text().splitlines()
    assert [json.loads(line)["index"] for line in lines] == [0, 1, 2, 3]
    assert not list(tmp_path.glob(".out.jsonl*"))


def test_a_partial_file_that_is_not_this_run_s_is_started_over(tmp_path: Path) -> None:
    (tmp_path / ".out.jsonl.partial").write_bytes(b'{"index":7,"id":null,"output":0}\n')
    out = ResultFile(tmp_path / "out.jsonl")
    assert out.open(resume=True) == 0
    out.discard()  # closes the file it opened


def test_input_lines_skip_blank_lines_a_byte_order_mark_and_the_first_items_asked(tmp_path: Path) -> None:
    (tmp_path / "in.jsonl").write_bytes(b'\xef\xbb\xbf{"a": 1}\n\n  \n{"a": 2}\r\n{"a": 3}')
    lines = list(input_lines(tmp_path / "in.jsonl"))
    assert [number for number, _ in lines] == [1, 4, 5]
    assert [json.loads(line) for _, line in lines] == [{"a": 1}, {"a": 2}, {"a": 3}]
    assert [number for number, _ in input_lines(tmp_path / "in.jsonl", skip=2)] == [5]


def test_the_state_a_killed_run_left_is_read_back_and_a_damaged_one_is_ignored(tmp_path: Path) -> None:
    state = RunState.beside(tmp_path / "out.jsonl", "f" * 64)
    assert state.previous() is None
    state.job_id, state.published = "00000000-0000-4000-8000-000000000001", 300
    state.save()
    assert state.previous() == state
    assert RunState.beside(tmp_path / "out.jsonl", "another input").previous() is None


@pytest.mark.parametrize(
    "saved",
    [
        b"{",
        b"[]",
        b'{"job_id": 5, "published": 1}',
        b'{"job_id": "j", "published": "300"}',
        b'{"job_id": "j", "published": -1}',
        b'{"job_id": "j"}',
    ],
)
def test_a_damaged_state_file_starts_the_run_afresh(tmp_path: Path, saved: bytes) -> None:
    state = RunState.beside(tmp_path / "out.jsonl", "f" * 64)
    fingerprint = b'{"fingerprint": "' + b"f" * 64 + b'", '
    state.path.write_bytes(fingerprint + saved[1:] if saved.startswith(b'{"') else saved)
    assert state.previous() is None
