"""The one-pass check of plain embeddings files (``plain_plan``, ``checked_plan``) against the line by line
check: the same plan for a file it takes, and for every other file the very errors at the very lines."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from api.uploads import checked_plan, file_lines
from worker.openai_compat import batchfile
from worker.openai_compat.batchfile import Answer, BatchPlan, answer_range, plan_batch
from worker.openai_compat.plain_lines import plain_plan
from worker.openai_compat.requests import EMBEDDINGS
from worker.openai_compat.responses import RawJson
from worker.openai_compat.tokens import detokenize
from worker.settings import Settings

SETTINGS = Settings(models=["minilm", "noop", "gpt2"], max_input_chars=1000)


def line(custom_id: object, model: object = "noop", text: object = "some text", **extra: Any) -> bytes:
    request = {
        "custom_id": custom_id,
        "method": "POST",
        "url": EMBEDDINGS,
        "body": {"model": model, "input": text},
    }
    return orjson.dumps({**request, **extra})


def plain(count: int, model: str = "noop") -> list[bytes]:
    return [line(f"r{i}", model, f"text {i}") for i in range(count)]


def shape(plan: BatchPlan) -> tuple[Any, ...]:
    lines = [(x.number, x.custom_id, x.request, x.first) for x in plan.lines]
    return lines, plan.items, plan.errors, plan.error_count


def by_lines(data: bytes, endpoint: str | None = EMBEDDINGS) -> BatchPlan:
    return plan_batch(file_lines(data), endpoint, SETTINGS, detokenize)


def test_a_plain_file_is_planned_in_one_pass_as_line_by_line() -> None:
    lines = plain(5) + [line("m0", "minilm", "a b"), line("r9", "noop", "x", method="POST")]
    for data in (b"\n".join(lines), b"\n".join(lines) + b"\n\n", b"\xef\xbb\xbf" + b"\r\n".join(lines)):
        fast = plain_plan(data, EMBEDDINGS, SETTINGS)
        assert fast is not None and shape(fast) == shape(by_lines(data))
    assert plain_plan(b"\n".join(lines), None, SETTINGS) is not None


HOSTILE = {
    "blank line": b"\n".join([*plain(2), b"", *plain(1)]),
    "bad json": b"\n".join([*plain(2), b'{"custom_id": "x",', *plain(1)]),
    "not an object": b"\n".join([*plain(2), b"[1, 2]"]),
    "two objects on a line": b"\n".join([plain(1)[0] + b"," + line("x"), line("y")]),
    "an object over two lines": b"\n".join(
        [
            b'{"custom_id": "a", "url": "/v1/embeddings"',
            b'"body": {"model": "noop", "input": "t"}}',
            line("b") + b"," + line("c"),
        ]
    ),
    # A string's newline becomes ",{" with the next line: one value of two lines, made up by a line of two.
    "an id over two lines": b"\n".join(
        [b'{"custom_id":"a', b'{b",' + line("x")[len(b'{"custom_id":"x",') :], line("c") + b"," + line("d")]
    ),
    "an input over two lines": b"\n".join(
        [line("a")[: -len(b'some text"}}')] + b"x", b'{y"}}', line("c") + b"," + line("d")]
    ),
    "duplicate ids": b"\n".join([line("a"), line("b"), line("a")]),
    "empty id": line(""),
    "long id": line("x" * 513),
    "id not a string": line(7),
    "wrong url": b"\n".join(
        [
            line("a"),
            orjson.dumps(
                {"custom_id": "b", "url": "/v1/completions", "body": {"model": "noop", "prompt": "p"}}
            ),
        ]
    ),
    "GET": line("a", method="GET"),
    "unknown model": line("a", "nope"),
    "a generation model": line("a", "gpt2"),
    "blank input": line("a", "noop", "   "),
    "too long input": line("a", "noop", "x" * 1001),
    "list input": line("a", "noop", ["x", "y"]),
    "token input": line("a", "noop", [1, 2]),
    "more fields": orjson.dumps(
        {"custom_id": "a", "url": EMBEDDINGS, "body": {"model": "noop", "input": "t", "dimensions": 0}}
    ),
    "extra top field": line("a", extra_field=1),
    "no body": orjson.dumps({"custom_id": "a", "url": EMBEDDINGS}),
    "empty": b"",
    "only newlines": b"\n\n",
    "invalid utf-8": line("a", "noop", "x").replace(b"x", b"\xff"),
    "nul byte": line("a", "noop", "x\x00y"),
    "a huge line": line("a", "noop", "word " * 300_000),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
@pytest.mark.parametrize("endpoint", [EMBEDDINGS, "/v1/completions", None])
def test_any_other_file_is_checked_line_by_line_with_the_same_errors(name: str, endpoint: str | None) -> None:
    data = HOSTILE[name]
    fast = plain_plan(data, endpoint, SETTINGS)
    slow = by_lines(data, endpoint)
    if fast is not None:  # taken in one pass only where the line by line check passes it too
        assert not slow.error_count and shape(fast) == shape(slow)
    assert shape(checked_plan(data, endpoint, SETTINGS)) == shape(slow)


def test_a_file_over_the_items_limit_fails_as_line_by_line() -> None:
    settings = Settings(models=["noop"], max_items_per_job=3)
    data = b"\n".join(plain(4))
    assert plain_plan(data, EMBEDDINGS, settings) is None
    assert checked_plan(data, EMBEDDINGS, settings).errors[0].code == "too_many_requests"


@pytest.mark.parametrize("count_tokens", [None, lambda model, texts: [len(text) for text in texts]])
def test_plain_lines_are_answered_in_bulk_as_line_by_line(
    monkeypatch: pytest.MonkeyPatch, count_tokens: Any
) -> None:
    plan = plain_plan(b"\n".join(plain(2500) + [line('q"\\u00e9', "noop", "x")]), EMBEDDINGS, SETTINGS)
    assert plan is not None
    stored: list[tuple[int, Any, str | None]] = [
        (i, RawJson("[0.5,-1.0]") if i % 3 else RawJson(b"0"), None) for i in range(2501) if i % 997
    ]
    stored[5] = (stored[5][0], None, "invalid input: no")
    stored[7] = (stored[7][0], [0.25, 0.5], None)

    def answers() -> list[Answer]:
        return list(
            answer_range(plan.lines[3:], {"noop": iter(stored)}, "batch_1", "cancelled", count_tokens)
        )

    bulk = answers()
    monkeypatch.setattr(batchfile, "_plain_model", lambda chunk: None)
    assert bulk == answers()
    assert sum(not answer.ok for answer in bulk) == 3  # items 997 and 1994 missing, and the error
