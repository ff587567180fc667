"""The NDJSON spool of the HTTP API: lines split anywhere across the body's pieces, errors naming the line,
and the messages it publishes holding every item once, in order. Pieces are checked here in this process;
the API checks them in its checking processes, with the same function."""

from __future__ import annotations

import tempfile

import orjson
import pytest
from fastapi import HTTPException
from hypothesis import given
from hypothesis import strategies as st

from api.spool import NdjsonSpool, Piece, check_piece, has_blank_line, part_bytes, part_ranges
from worker.broker.producer import parts
from worker.models.base import InvalidInput
from worker.settings import Settings

SETTINGS = Settings(submit_chunk_size=7, max_items_per_job=50, max_input_chars=100)


def spooled(pieces: list[bytes], settings: Settings = SETTINGS) -> list[list[object]]:
    """The items of each message the spool would publish, checking the parts' offsets on the way."""
    with tempfile.NamedTemporaryFile() as file:
        spool = NdjsonSpool("noop", "bulk", settings, file)
        for data in pieces:
            add(spool, spool.piece(data))
        add(spool, spool.last_piece())
        spool.finish()
        parts = list(spool.parts())
    assert spool.priority == "bulk"
    offsets = [offset for offset, _ in parts]
    items = [orjson.loads(b"[" + joined + b"]") for _, joined in parts]
    assert offsets == [sum(map(len, items[:i])) for i in range(len(items))]
    assert all(1 <= len(part) <= settings.submit_chunk_size for part in items)
    return items


def add(spool: NdjsonSpool, piece: Piece | None) -> None:
    if piece is not None:
        spool.add(check_piece(piece, spool.model, spool.priority, spool.settings))


@given(count=st.integers(1, 40), cuts=st.lists(st.integers(0, 2000), max_size=12))
def test_every_item_is_published_once_in_order_wherever_the_body_is_cut(count: int, cuts: list[int]) -> None:
    items = [{"id": f"d{i}", "text": f"text {i}"} for i in range(count)]
    body = b"\n\n".join(orjson.dumps(item) for item in items)  # blank lines are skipped
    edges = sorted({0, len(body), *(cut % (len(body) + 1) for cut in cuts)})
    pieces = [body[start:end] for start, end in zip(edges, edges[1:], strict=False)]

    published = [item for chunk in spooled(pieces) for item in chunk]

    assert published == items


def test_lines_are_published_as_they_came_crlf_and_spacing_included() -> None:
    body = b'{"text": "a",  "id": "x"}\r\n  "b"\t\n'
    with tempfile.NamedTemporaryFile() as file:
        spool = NdjsonSpool("noop", "normal", SETTINGS, file)
        add(spool, spool.piece(body))
        spool.finish()
        assert list(spool.parts()) == [(0, b'{"text": "a",  "id": "x"}\r,  "b"\t')]


def test_a_leading_byte_order_mark_is_no_part_of_the_first_line() -> None:
    # As `batchwork run` and an uploaded OpenAI file take it (a Windows tool's export begins with one).
    body = b'{"text": "a"}\n"b"\n'
    assert spooled([b"\xef\xbb\xbf" + body]) == spooled([body]) == [[{"text": "a"}, "b"]]
    assert spooled([b"\xef\xbb\xbf" + body[:5], body[5:]]) == [[{"text": "a"}, "b"]]


@pytest.mark.parametrize(
    ("body", "error"),
    [
        (b'"a"\n"b"\n{"text": \n', "line 3, column 10: not valid JSON (unexpected end of data)"),
        # One line number, the body's (orjson's own message names the line within the piece), and the
        # column of a byte that is not UTF-8 (orjson says column 1).
        (b'"a"\n' * 6 + b'{"text": "caf\xe9"}\n', "line 7, column 14: not UTF-8 (byte 0xe9"),
        (b'"\xc3\xa9t\xc3\xa9"\n"x\xffy"\n', "line 2, column 3: not UTF-8 (byte 0xff"),
        (b'"a"\n\n{"id": 1, "text": ""}\n', "line 3: field 'text' is empty"),
        (b'"a"\n' * 9 + b"17\n", "line 10: expected a string or an object with field 'text'"),
        (b"\n\n", "the body holds no inputs"),
    ],
)
@pytest.mark.parametrize("cut", ["whole", "byte by byte"])
def test_a_bad_line_is_refused_by_its_number(body: bytes, error: str, cut: str) -> None:
    pieces = [body] if cut == "whole" else [body[i : i + 1] for i in range(len(body))]
    with pytest.raises(InvalidInput) as refused:
        spooled(pieces)
    assert str(refused.value).startswith(error)


def test_too_many_items_is_429_and_an_endless_line_is_refused_before_it_fills_memory() -> None:
    with pytest.raises(HTTPException) as refused:
        spooled([b'"x"\n' * 51])
    assert refused.value.status_code == 429
    with pytest.raises(InvalidInput, match="line 2: over"):
        spooled([b'"x"\n"', b"y" * 70_000])


@given(
    sizes=st.lists(st.integers(0, 6), max_size=30),
    chunk=st.integers(1, 5),
    start=st.integers(0, 9),
)
def test_part_ranges_cut_lines_as_the_producer_cuts_items(sizes: list[int], chunk: int, start: int) -> None:
    # A size 0 is a blank line: it ends a part and is no item. Otherwise the parts are the producer's own.
    lines = [b"x" * size for size in sizes]
    data = b"#" * start + b"\n".join(lines)
    ranges = part_ranges(start, lines, chunk)
    runs: list[list[bytes]] = [[]]
    for line in lines:
        runs[-1].append(line) if line else runs.append([])
    expected, offset = [], 0
    for run in filter(None, runs):
        expected += [(offset + at, joined) for at, joined in parts(0, run, chunk)]
        offset += len(run)
    assert [(at, data[first:end].replace(b"\n", b",")) for at, first, end in ranges] == expected
    if lines and 0 not in sizes:  # no blank line: cut by count alone, the same parts
        assert part_ranges(start, lines, chunk, blank=False) == ranges


@given(
    st.lists(st.sampled_from([b"", b" ", b"\r", b"\x0c", b"x", b" x", b'"a"\r']), max_size=6), st.booleans()
)
def test_blank_lines_are_found_in_one_scan(lines: list[bytes], newline: bool) -> None:
    data = b"\n".join(lines) + (b"\n" if newline and lines else b"")
    split = data.split(b"\n")
    if data.endswith(b"\n"):
        split.pop()
    assert has_blank_line(data, split) == any(not line.strip() for line in split)


@pytest.mark.parametrize("count", [1, 7, 8, 30, 50])
@pytest.mark.parametrize("slices", [1, 2, 3, 8])
def test_the_parts_split_into_runs_for_the_sending_processes_hold_each_part_once_in_order(
    count: int, slices: int
) -> None:
    """``part_ranges(n)``: at most n runs of consecutive parts, the first holding the job's first message."""
    body = b"".join(orjson.dumps({"text": f"item {i}"}) + b"\n" for i in range(count))
    with tempfile.NamedTemporaryFile() as file:
        spool = NdjsonSpool("noop", "normal", SETTINGS, file)
        add(spool, spool.piece(body))
        spool.finish()
        runs = spool.part_ranges(slices)
        whole = list(spool.parts())
        assert 1 <= len(runs) <= slices and all(runs)
        assert runs[0][0][0] == 0
        with open(spool.path, "rb", buffering=0) as read:
            assert [part for run in runs for part in part_bytes(read.fileno(), run)] == whole
