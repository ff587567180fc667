"""The plain values the store takes and gives back: jobs, item records, batch records, token counts.

Frozen dataclasses, no SQL; the runtime, the client and the API pass these across layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any


class JobState(StrEnum):
    """A job's state, as the jobs table stores it and every surface shows it (a str: it compares equal to
    its value, and JSON and SQL take it as its value)."""

    QUEUED = "queued"  # accepted; no item stored yet
    RUNNING = "running"  # some items stored
    SUCCEEDED = "succeeded"  # every item stored with an output
    FAILED = "failed"  # every item failed, or the job as a whole (its error says why)
    PARTIAL = "partial"  # every item stored, some failed
    CANCELLED = "cancelled"


# A job in one of these states never changes state again (late or redelivered results still count).
FINISHED_STATES = (JobState.SUCCEEDED, JobState.FAILED, JobState.PARTIAL, JobState.CANCELLED)
UNFINISHED_STATES = (JobState.QUEUED, JobState.RUNNING)


@dataclass(frozen=True, slots=True)
class JobSpec:
    """What the worker knows of a job from its messages: enough to create the job row if it is missing."""

    job_id: str
    model: str
    priority: str
    total: int
    created_at: float | None = None  # Unix time the producer accepted the job; None: when it is recorded


@dataclass(frozen=True, slots=True)
class ItemRecord:
    """One item's result as the store writes and reads it: its output, or the error that stopped it (never
    both, never neither), with its job, index, user id and generated tokens. Readers outside the worker get
    an ItemResult (worker/jobs.py)."""

    job_id: str
    index: int
    item_id: str | None
    output: Any = None
    error: str | None = None
    tokens: int | None = None  # tokens the model generated for it, for models that generate

    def __post_init__(self) -> None:
        if (self.output is None) == (self.error is None):
            raise ValueError(
                f"job {self.job_id} item {self.index}: set exactly one of output and error "
                f"(output is {'None' if self.output is None else 'set'}, error is {self.error!r})"
            )

    def as_error(self, error: str, *, keep_id: bool = True) -> ItemRecord:
        """This item, ended with ``error`` instead (its output could not be stored); an error stays."""
        if self.error is not None and keep_id:
            return self
        return ItemRecord(
            self.job_id, self.index, self.item_id if keep_id else None, error=self.error or error
        )


@dataclass(slots=True)
class ItemColumns:
    """Many ItemRecords as columns, row i being item i: what a worker hands the store by the thousand,
    without an object per item. Each row has exactly one of output and error, as an ItemRecord."""

    job_ids: list[str] = field(default_factory=list)
    indices: list[int] = field(default_factory=list)
    item_ids: list[str | None] = field(default_factory=list)
    outputs: list[Any] = field(default_factory=list)
    errors: list[str | None] = field(default_factory=list)
    tokens: list[int | None] | None = None  # None: no row has a token count

    def __len__(self) -> int:
        return len(self.indices)

    def append(self, outcome: ItemRecord) -> None:
        if outcome.tokens is not None and self.tokens is None:
            self.tokens = [None] * len(self.indices)
        self.job_ids.append(outcome.job_id)
        self.indices.append(outcome.index)
        self.item_ids.append(outcome.item_id)
        self.outputs.append(outcome.output)
        self.errors.append(outcome.error)
        if self.tokens is not None:
            self.tokens.append(outcome.tokens)

    def extend(
        self,
        job_id: str,
        indices: list[int],
        item_ids: list[str | None],
        outputs: list[Any],
        errors: list[str | None],
    ) -> None:
        """Rows of one job (no token counts)."""
        self.job_ids += [job_id] * len(indices)
        self.indices += indices
        self.item_ids += item_ids
        self.outputs += outputs
        self.errors += errors
        if self.tokens is not None:
            self.tokens += [None] * len(indices)

    @staticmethod
    def of(outcomes: Sequence[ItemRecord]) -> ItemColumns:
        columns = ItemColumns()
        for outcome in outcomes:
            columns.append(outcome)
        return columns

    def outcomes(self) -> list[ItemRecord]:
        tokens = self.tokens or [None] * len(self.indices)
        return [
            ItemRecord(*row)
            for row in zip(
                self.job_ids, self.indices, self.item_ids, self.outputs, self.errors, tokens, strict=True
            )
        ]


@dataclass(frozen=True, slots=True)
class BatchRecord:
    """One forward pass: its model and lane, its size in items and tokens, and its timings."""

    model: str
    lane: str
    size: int
    real_tokens: int
    padded_tokens: int
    wait_ms: float
    run_ms: float
    started_at: datetime
    worker: str


# One batch to store: its record (None for outcomes that never reached a model), its outcomes, and a JobSpec
# for every job among them (a job row still missing is created from it).
BatchWrite = tuple["BatchRecord | None", "Sequence[ItemRecord] | ItemColumns", Sequence["JobSpec"]]


@dataclass(frozen=True, slots=True)
class Stored:
    """What one transaction stored: the new result rows of each batch written, the job rows it created, and
    the jobs whose outcomes it refused (their messages disagree with the job's model or total)."""

    new_rows: list[int]
    new_jobs: frozenset[str] = frozenset()
    refused_jobs: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class TokenCount:
    """Tokens generated so far for one running item (a worker's report; the stored result's is final)."""

    job_id: str
    index: int
    tokens: int


@dataclass(frozen=True, slots=True)
class JobStatus:
    job_id: str
    model: str
    priority: str
    state: JobState
    total: int
    done: int
    failed: int
    error: str | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    # Generation jobs only (None otherwise): tokens generated so far, by stored and by running items, and
    # of those by the running ones (as last reported; 0 once the job has finished).
    generated_tokens: int | None = None
    running_tokens: int | None = None
    tenant: str = "default"
    metadata: Any = None  # the submitter's JSON value, as given
    # The most common errors of its failed items, with how many items each, most common first.
    errors: tuple[tuple[str, int], ...] = field(default=())
