"""How a producer cuts a job's items into messages: at most chunk_size items and about MAX_MESSAGE_BYTES each,
every item once and in order, offsets counting from the call's."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from worker.broker.producer import MAX_MESSAGE_BYTES, chunked_parts, ordered_parts, parts
from worker.errors import InvalidInput


@given(sizes=st.lists(st.integers(1, 400_000), min_size=1, max_size=30), chunk=st.integers(1, 8))
def test_parts_hold_every_item_once_in_order_under_both_caps(sizes: list[int], chunk: int) -> None:
    encoded = [orjson.dumps("x" * size) for size in sizes]

    cut = list(parts(1000, encoded, chunk))

    items = [orjson.loads(b"[" + joined + b"]") for _, joined in cut]
    assert [item for part in items for item in part] == ["x" * size for size in sizes]
    assert [offset for offset, _ in cut] == [1000 + sum(map(len, items[:i])) for i in range(len(items))]
    for part, (_, joined) in zip(items, cut, strict=True):
        assert 1 <= len(part) <= chunk
        assert len(part) == 1 or len(joined) <= MAX_MESSAGE_BYTES + len(part)  # the commas


@given(
    sizes=st.lists(st.integers(1, 30), min_size=1, max_size=40), chunk=st.integers(1, 8), seed=st.randoms()
)
def test_ordered_parts_name_each_items_index_once_beside_its_json(sizes: list[int], chunk: int, seed) -> None:
    order = list(range(len(sizes)))
    seed.shuffle(order)
    encoded = [orjson.dumps(f"item {index}") for index in order]

    cut = list(ordered_parts(order, encoded, chunk))

    assert [index for _, _, indices in cut for index in indices] == order
    for offset, joined, indices in cut:
        assert offset == 0 and 1 <= len(indices) <= chunk
        assert orjson.loads(b"[" + joined + b"]") == [f"item {index}" for index in indices]


@given(sizes=st.lists(st.integers(1, 400_000), max_size=30), chunk=st.integers(1, 8))
def test_parts_written_a_chunk_at_a_time_are_the_parts_written_item_by_item(
    sizes: list[int], chunk: int
) -> None:
    items = ["x" * size for size in sizes]

    assert list(chunked_parts(items, 7, chunk)) == list(parts(7, map(orjson.dumps, items), chunk))


def test_an_item_that_is_not_json_is_named_by_its_job_index() -> None:
    items: list[object] = ["a"] * 10 + [object()]
    with pytest.raises(InvalidInput) as refused:
        list(chunked_parts(items, 100, 4))
    assert refused.value.index == 110
