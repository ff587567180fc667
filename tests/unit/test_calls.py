"""The checks every call and message passes: arguments, job ids, counts, item ids; no services needed."""

from __future__ import annotations

import uuid

import pytest
from hypothesis import given
from hypothesis import strategies as st

from worker.calls import (
    MAX_ITEM_ID_CHARS,
    NewJob,
    check_item,
    check_items,
    item_id,
    job_id_of,
    new_job,
    parse_message,
    plain_items,
    plain_texts,
)
from worker.client import ORDER_WINDOW_CHUNKS, length_order
from worker.errors import InvalidInput
from worker.models.noop import Noop
from worker.settings import Settings

SETTINGS = Settings(max_items_per_job=100, max_input_chars=50)
JOB = str(uuid.uuid4())


def message(**kwargs: object) -> dict[str, object]:
    return {"model": "noop", "inputs": ["a", "b"], "job_id": JOB, "offset": 0, "total": 2, **kwargs}


def test_a_good_message_parses_into_its_call() -> None:
    call = parse_message("task", message(priority="bulk", expires_at=1.5e9, created_at=1.4e9), SETTINGS)
    assert (call.job_id, call.model, call.priority, call.offset, call.total) == (JOB, "noop", "bulk", 0, 2)
    assert (call.expires_at, call.created_at) == (1.5e9, 1.4e9)


def test_a_message_naming_its_indices_maps_each_position_to_its_index() -> None:
    call = parse_message("task", message(inputs=["a", "b", "c"], total=9, indices=[7, 0, 3]), SETTINGS)
    assert [call.index(position) for position in range(3)] == [7, 0, 3]
    plain = parse_message("task", message(offset=4, total=6), SETTINGS)
    assert [plain.index(position) for position in range(2)] == [4, 5]


def test_a_message_without_job_id_is_its_task_id() -> None:
    task = str(uuid.uuid4())
    assert parse_message(task, {"model": "noop", "inputs": ["a"]}, SETTINGS).job_id == task


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        (message(job_id="x" * 300), "job_id must be a UUID"),
        (message(job_id=JOB.upper()), "job_id must be a UUID"),
        (message(job_id=7), "job_id must be a UUID"),
        (message(model="this:Zen"), "unknown model 'this:Zen'"),
        (message(model=["noop"]), "unknown model ['noop']"),
        (message(inputs="ab"), "argument 'inputs' must be a list"),
        (message(inputs={"text": "a"}), "argument 'inputs' must be a list"),
        (message(inputs=[]), "argument 'inputs' is empty"),
        (message(priority="urgent"), "argument 'priority' must be one of high, normal, bulk"),
        (message(offset=-1), "argument 'offset' must be a non-negative integer"),
        (message(offset=True), "argument 'offset' must be a non-negative integer"),
        (message(total=2**40), "argument 'total' must be a non-negative integer"),
        (message(total=1), "items 0..1 lie beyond the job's total of 1"),
        (message(offset=5, total=6), "items 5..6 lie beyond the job's total of 6"),
        (message(total=101), "a job holds at most 100 items"),
        (message(expires_at="soon"), "argument 'expires_at' must be a Unix time"),
        (message(expires_at=float("nan")), "argument 'expires_at' must be a Unix time"),
        (message(created_at=[1]), "argument 'created_at' must be a Unix time"),
        (message(extra=1), "unknown argument(s) 'extra'"),
        (message(indices=[0]), "argument 'indices' must be a list of 2 job indices"),
        (message(indices="01"), "argument 'indices' must be a list of 2 job indices"),
        (message(indices=[0, 2]), "argument 'indices' must hold integers from 0 to 1"),
        (message(indices=[0, True]), "argument 'indices' must hold integers from 0 to 1"),
        (message(indices=[-1, 0]), "argument 'indices' must hold integers from 0 to 1"),
        (message(indices=[1, 1]), "argument 'indices' names an item twice"),
        ("not kwargs", "keyword arguments are not an object"),
    ],
)
def test_a_bad_message_is_refused_naming_the_argument(kwargs: object, fragment: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        parse_message(str(uuid.uuid4()), kwargs, SETTINGS)
    assert fragment in str(caught.value)
    assert len(str(caught.value)) < 400  # one line, whatever the message carried


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"model": "noop", "inputs": "a string"}, "argument 'inputs' must be a list"),
        ({"model": "noop", "inputs": b"bytes"}, "argument 'inputs' must be a list"),
        ({"model": "noop", "inputs": ["a"], "job_id": JOB}, "unknown argument(s) 'job_id'"),
        ({"model": "noop", "inputs": ["a"], "total": 5}, "unknown argument(s) 'total'"),
        ({"model": "noop", "inputs": ["a"], "deadline_s": 0}, "'deadline_s' must be a positive number"),
        ({"model": "noop", "inputs": ["a"], "deadline_s": True}, "'deadline_s' must be a positive number"),
        ({"model": "noop", "inputs": ["a"] * 101}, "a job holds at most 100 items"),
        ({"inputs": ["a"]}, "unknown model None"),
    ],
)
def test_a_bad_call_is_refused_naming_the_argument(kwargs: dict[str, object], fragment: str) -> None:
    with pytest.raises(InvalidInput, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        new_job(JOB, kwargs, SETTINGS)


@pytest.mark.parametrize(
    ("item", "expected"),
    [
        ({"id": "doc-1", "text": "a"}, "doc-1"),
        ({"id": 7, "text": "a"}, "7"),
        ({"text": "a"}, None),
        ({"id": None, "text": "a"}, None),
        ("plain text", None),
        ({"id": "é" * MAX_ITEM_ID_CHARS, "text": "a"}, "é" * MAX_ITEM_ID_CHARS),
    ],
)
def test_item_ids_are_strings_or_integers(item: object, expected: str | None) -> None:
    assert item_id(0, item) == expected


@pytest.mark.parametrize(
    ("ident", "fragment"),
    [
        ("L" * (MAX_ITEM_ID_CHARS + 1), f"has {MAX_ITEM_ID_CHARS + 1} characters, over the limit"),
        (True, "must be a string or an integer"),
        (1.5, "must be a string or an integer"),
        ({"a": 1}, "must be a string or an integer"),
        (10 ** (MAX_ITEM_ID_CHARS + 1), f"has {MAX_ITEM_ID_CHARS + 2} characters, over the limit"),
        # str() of an integer of over 4,300 digits raises ValueError: refused before it is written out.
        pytest.param(10**5000, f"is an integer of over {MAX_ITEM_ID_CHARS} digits", id="10**5000"),
        pytest.param(-(2**100_000), f"is an integer of over {MAX_ITEM_ID_CHARS} digits", id="-2**100000"),
    ],
)
def test_an_item_id_the_store_cannot_keep_is_refused(ident: object, fragment: str) -> None:
    with pytest.raises(InvalidInput, match=f"item 3: field 'id' {fragment}"):
        check_item(Noop, 3, {"id": ident, "text": "a"}, SETTINGS)


def test_a_model_check_that_breaks_fails_its_item_in_one_line() -> None:
    class Broken(Noop):
        @classmethod
        def validate(cls, index: int, item: object, settings: Settings) -> object:
            raise KeyError("surprise")

    with pytest.raises(InvalidInput, match="item 2: the model's check failed: KeyError: 'surprise'"):
        check_item(Broken, 2, "a", SETTINGS)


def test_check_items_names_the_first_bad_item_by_its_index_in_the_job() -> None:
    call = parse_message("t", message(inputs=["ok", "", "ok"], offset=10, total=20), SETTINGS)
    with pytest.raises(InvalidInput) as caught:
        check_items(call, SETTINGS)
    assert caught.value.index == 11


@given(st.text(max_size=60))
def test_only_canonical_uuids_are_job_ids(text: str) -> None:
    try:
        assert job_id_of(text) == str(uuid.UUID(text)) == text
    except (InvalidInput, ValueError):
        with pytest.raises(InvalidInput):
            job_id_of(text)


def test_a_length_bucketed_models_items_go_shortest_first_within_windows() -> None:
    settings = Settings(submit_chunk_size=2)  # windows of 2 x ORDER_WINDOW_CHUNKS items
    window = 2 * ORDER_WINDOW_CHUNKS
    texts = [{"text": "x" * (50 - i % 40)} for i in range(3 * window)]
    call = NewJob(JOB, "minilm", texts, total=len(texts))
    order = length_order(call, settings)
    assert order is not None and sorted(order) == list(range(len(texts)))
    for start in range(0, len(texts), window):
        part = order[start : start + window]
        assert sorted(part) == list(range(start, start + window))  # nothing crosses a window
        assert [len(texts[i]["text"]) for i in part] == sorted(len(texts[i]["text"]) for i in part)
    # A model without length buckets, or items already in order, keep the plain consecutive messages.
    assert length_order(NewJob(JOB, "noop", texts, total=len(texts)), settings) is None
    assert length_order(NewJob(JOB, "minilm", ["a", "bb", "ccc"], total=3), settings) is None


def _one_by_one(items: list[object]) -> list[object] | None:
    """What checking each item alone makes of a list: the checked forms if every item passes and none has
    an id, else None."""
    checked = []
    for index, item in enumerate(items):
        try:
            value, ident = check_item(Noop, index, item, SETTINGS)
        except InvalidInput:
            return None
        if ident is not None:
            return None
        checked.append(value)
    return checked


ITEM = st.one_of(
    st.text(max_size=60),
    st.sampled_from(["", " ", "\t\n", "ok", "x" * 50, "x" * 51]),
    st.fixed_dictionaries({"text": st.text(max_size=55)}),
    st.fixed_dictionaries(
        {"text": st.text(min_size=1, max_size=5), "id": st.sampled_from([None, 0, "", "a"])}
    ),
    st.fixed_dictionaries({"body": st.just("a")}),
    st.integers(),
    st.none(),
)


@given(st.lists(ITEM, max_size=8))
def test_texts_checked_a_list_at_a_time_agree_with_checking_each_alone(items: list[object]) -> None:
    # The list-wide check may decline a list the item-by-item check takes (the worker then checks each),
    # but what it accepts must be exactly what the item-by-item check makes, and nothing it refuses.
    texts = plain_texts(Noop, items, SETTINGS)
    if texts is not None:
        assert texts == _one_by_one(items)
    elif items and all(isinstance(item, str) for item in items):
        assert _one_by_one(items) is None  # plain strings are declined only for an item that fails


def test_texts_of_a_model_with_its_own_check_are_checked_item_by_item() -> None:
    class Strict(Noop):
        @classmethod
        def validate(cls, index: int, item: object, settings: Settings) -> object:
            raise InvalidInput("never", index)

    assert plain_texts(Strict, ["a", "b"], SETTINGS) is None
    assert plain_texts(Noop, ["a", {"text": "b"}], SETTINGS) is None  # mixed shapes: item by item
    assert plain_texts(Noop, [{"text": "a"}, {"text": "b"}], SETTINGS) == ["a", "b"]


ITEM_WITH_ID = st.fixed_dictionaries(
    {"text": st.sampled_from(["a", "", " ", "x" * 51])},
    optional={
        "id": st.one_of(
            st.none(),
            st.booleans(),
            st.integers(min_value=-(2**70), max_value=2**70),
            st.text(max_size=3),
            st.sampled_from(["x" * 200, "x" * 201, "a\x00", "\ud800"]),
            st.floats(allow_nan=False),
        )
    },
)


@given(st.lists(ITEM_WITH_ID, max_size=8))
def test_items_with_ids_checked_a_list_at_a_time_agree_with_checking_each_alone(items: list[object]) -> None:
    # As the texts above, with the user ids that item_id makes of each item (None where none has one).
    plain = plain_items(Noop, items, SETTINGS)
    try:
        each = [check_item(Noop, index, item, SETTINGS) for index, item in enumerate(items)]
    except InvalidInput:
        each = None
    if plain is not None:
        assert each is not None
        texts, ids = plain
        assert texts == [text for text, _ in each]
        assert (ids or [None] * len(items)) == [ident for _, ident in each]


def test_plain_items_carry_ids_and_decline_what_item_id_refuses() -> None:
    assert plain_items(Noop, [{"text": "a", "id": 7}, {"text": "b", "id": "x"}], SETTINGS) == (
        ["a", "b"],
        ["7", "x"],
    )
    assert plain_items(Noop, [{"text": "a", "id": None}, {"text": "b"}], SETTINGS) == (["a", "b"], None)
    assert plain_items(Noop, [{"text": "a", "id": None}, {"text": "b", "id": 1}], SETTINGS) == (
        ["a", "b"],
        [None, "1"],
    )
    for bad in (True, 1.5, "x" * 201, "a\x00", 10**5000):
        assert plain_items(Noop, [{"text": "a", "id": bad}], SETTINGS) is None
