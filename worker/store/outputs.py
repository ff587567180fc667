"""Reads of stored outcomes in the shapes the OpenAI surface answers with: the outcomes of many jobs at once
(synchronous embeddings, one query for every waiting request), how far a job's outcomes run from an index
without a gap (a batch's next lines to answer), and a range's outputs as their JSON text, never decoded
(joined into one value by PostgreSQL where every one is stored without an error).

Plain functions over an Engine, as ``bulk`` and ``rows`` are; the callers own retries and error wording.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine, Text, cast, func, literal_column, select
from sqlalchemy.dialects.postgresql import aggregate_order_by

from worker.store import tables

_RESULT = tables.results.c

OutputOrError = tuple[Any, str | None]  # (output, error) of one item


def outcomes_of(engine: Engine, job_ids: list[str]) -> dict[str, dict[int, OutputOrError]]:
    """Every stored outcome of ``job_ids``, by job and item index (jobs with none are absent)."""
    query = select(_RESULT.job_id, _RESULT.item_index, _RESULT.output, _RESULT.error).where(
        _RESULT.job_id.in_(job_ids)
    )
    found: dict[str, dict[int, OutputOrError]] = {}
    with engine.connect() as conn:
        for job_id, index, output, error in conn.execute(query):
            found.setdefault(job_id, {})[index] = (output, error)
    return found


def stored_through(engine: Engine, job_id: str, start: int, window: int) -> int:
    """The item index after the run of stored outcomes from ``start`` (``start`` if it has none), looking at
    most ``window`` items ahead."""
    where = (_RESULT.job_id == job_id, _RESULT.item_index >= start, _RESULT.item_index < start + window)
    with engine.connect() as conn:
        # Counted first (this runs at every poll while the jobs run): indices are unique, so a count that
        # reaches the highest one means no gap, and no index needs to leave the database.
        count, highest = conn.execute(select(func.count(), func.max(_RESULT.item_index)).where(*where)).one()
        if not count or highest == start + count - 1:
            return start + count
        indices = list(conn.scalars(select(_RESULT.item_index).where(*where).order_by(_RESULT.item_index)))
    if not indices or indices[0] != start:
        return start
    low, high = 0, len(indices) - 1  # the last position p with indices[p] == start + p
    while low < high:
        middle = (low + high + 1) // 2
        if indices[middle] == start + middle:
            low = middle
        else:
            high = middle - 1
    return start + low + 1


def output_texts(
    engine: Engine, job_id: str, start: int, stop: int
) -> list[tuple[int, str | None, str | None]]:
    """The stored outcomes of items [start, stop) in index order: (index, output as its JSON text, error)."""
    query = (
        select(_RESULT.item_index, cast(_RESULT.output, Text), _RESULT.error)
        .where(_RESULT.job_id == job_id, _RESULT.item_index >= start, _RESULT.item_index < stop)
        .order_by(_RESULT.item_index)
    )
    with engine.connect() as conn:
        return [(index, output, error) for index, output, error in conn.execute(query)]


def joined_output_texts(engine: Engine, job_id: str, start: int, stop: int) -> list[str] | None:
    """On PostgreSQL, the outputs of items [start, stop) as JSON texts when every one is stored without an
    error (the common case), joined by the database into one value: one to fetch, not three per row (which
    was most of the API's work for a batch). None otherwise: read them with ``output_texts``."""
    if engine.dialect.name != "postgresql":
        return None
    output = cast(_RESULT.output, Text)
    query = select(
        func.count(),
        func.count(output),
        func.count(_RESULT.error),
        func.string_agg(output, aggregate_order_by(literal_column("E'\\n'"), _RESULT.item_index)),
    ).where(_RESULT.job_id == job_id, _RESULT.item_index >= start, _RESULT.item_index < stop)
    with engine.connect() as conn:
        count, outputs, errors, joined = conn.execute(query).one()
    # Each output is JSON as stored (compact: no newline), so count - 1 newlines are the joins.
    if count != stop - start or outputs != count or errors or joined.count("\n") != count - 1:
        return None
    texts: list[str] = joined.split("\n")
    return texts
