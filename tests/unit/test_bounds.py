"""worker/bounds.py over many values: what may reach SQL, a column or a slice; the rest refused in a line."""

from __future__ import annotations

import re
import uuid

import pytest
from hypothesis import given
from hypothesis import strategies as st

from worker.bounds import (
    MAX_COUNT,
    MAX_JSON_DEPTH,
    all_storable,
    check_json,
    check_text,
    is_count,
    is_job_id,
    unstorable,
)
from worker.calls import item_id, job_id_of
from worker.errors import InvalidInput

UNSTORABLE = ("\x00", "\ud800", "\udfff", "\udc80")
json_numbers = st.floats(allow_nan=False, allow_infinity=False) | st.integers(-(2**63), 2**64 - 1)
json_leaves = st.none() | st.booleans() | json_numbers  # no NaN nor infinity in JSON: refused (below)
json_values = st.recursive(
    json_leaves | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


@given(st.text())
def test_a_text_is_storable_exactly_when_it_has_no_nul_and_no_lone_surrogate(text: str) -> None:
    bad = any(char == "\x00" or 0xD800 <= ord(char) <= 0xDFFF for char in text)
    assert (unstorable(text) is not None) == bad
    if not bad:
        assert check_text(text, "x") == text
        text.encode("utf-8")  # what a driver does with it


@given(st.text(max_size=20), st.sampled_from(UNSTORABLE), st.text(max_size=20))
def test_an_unstorable_character_anywhere_is_refused_in_one_line(before: str, bad: str, after: str) -> None:
    with pytest.raises(InvalidInput) as refused:
        check_text(before + bad + after, "field 'id'", 3)
    message = str(refused.value)
    assert message.startswith("item 3: field 'id' holds ") and "\n" not in message
    assert "\x00" not in message and not any(0xD800 <= ord(c) <= 0xDFFF for c in message)


@given(json_values)
def test_storable_json_passes_whole(value: object) -> None:
    storable = all(unstorable(text) is None for text in _texts(value))
    if storable:
        assert check_json(value, "metadata") is value
    else:
        with pytest.raises(InvalidInput, match="^metadata|^a key of metadata"):
            check_json(value, "metadata")


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ({"a\x00": 1}, "a key of metadata holds a NUL"),
        ({"a": ["x", {"b": "\ud800"}]}, "metadata holds a lone surrogate (U+D800)"),
        ({"n": 2**64}, "an integer beyond 64 bits"),
        ({"n": -(2**63) - 1}, "an integer beyond 64 bits"),
        pytest.param({"n": 10**5000}, "an integer beyond 64 bits (of 16610 bits)", id="10**5000"),
        ({"x": float("nan")}, "metadata holds nan, which JSON cannot hold"),
        ({"x": [float("-inf")]}, "metadata holds -inf, which JSON cannot hold"),
        ({1: "x"}, "a key that is not a string"),
        ({"s": {1, 2}}, "holds a set, which is not JSON"),
        ({"b": b"bytes"}, "holds a bytes"),
        ([[[{"fine": [1, 2.5, None, True, "é"]}]]], None),
    ],
)
def test_json_the_store_cannot_keep_is_named(value: object, problem: str | None) -> None:
    if problem is None:
        assert check_json(value, "metadata") is value
        return
    with pytest.raises(InvalidInput, match=re.escape(problem)):
        check_json(value, "metadata")


def test_json_deeper_than_the_bound_is_refused_not_a_recursion_error() -> None:
    deep: list[object] = []
    for _ in range(MAX_JSON_DEPTH + 1):
        deep = [deep]
    with pytest.raises(InvalidInput, match=f"deeper than {MAX_JSON_DEPTH}"):
        check_json(deep, "metadata")
    very_deep: dict[str, object] = {}
    for _ in range(100_000):  # no recursion: a walk over a stack
        very_deep = {"a": very_deep}
    with pytest.raises(InvalidInput):
        check_json(very_deep, "metadata")


@given(st.uuids())
def test_every_canonical_uuid_is_a_job_id(value: uuid.UUID) -> None:
    assert is_job_id(str(value)) and job_id_of(str(value)) == str(value)
    assert not is_job_id(str(value).upper()) and not is_job_id(value.hex) and not is_job_id(str(value) + "\n")


@given(st.text(max_size=40) | st.integers() | st.none() | st.binary(max_size=40))
def test_anything_else_is_no_job_id(value: object) -> None:
    try:
        canonical = isinstance(value, str) and str(uuid.UUID(value)) == value
    except ValueError:
        canonical = False
    assert is_job_id(value) == canonical


@given(st.integers(-(2**70), 2**70) | st.booleans())
def test_counts_are_32_bit_and_never_negative(value: int) -> None:
    assert is_count(value) == (not isinstance(value, bool) and 0 <= value <= MAX_COUNT)


@given(st.text(max_size=60) | st.integers(-(2**70), 2**70))
def test_an_item_id_that_passes_is_storable_and_bounded(ident: str | int) -> None:
    try:
        found = item_id(0, {"id": ident, "text": "t"})
    except InvalidInput as exc:
        assert "\n" not in str(exc)
        assert isinstance(ident, str) and (unstorable(ident) is not None or len(ident) > 200)
        return
    assert found is not None and unstorable(found) is None and len(found) <= 200


def _texts(value: object) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [t for k, v in value.items() for t in (k, *_texts(v))]
    if isinstance(value, list):
        return [t for v in value for t in _texts(v)]
    return []


@given(st.lists(st.text(st.sampled_from(["a", "\x00", "\ud800", "\udfff", "\ue000", "\n"]), max_size=4)))
def test_texts_storable_at_once_agree_with_each_alone(texts: list[str]) -> None:
    assert all_storable(texts) == all(unstorable(text) is None for text in texts)
