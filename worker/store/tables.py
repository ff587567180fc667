"""The SQL schema of batchwork: jobs, their per-item results, the batches that produced them, the
tokens generated per item so far, the HTTP API's keys, and the batching limits tuned per model and device
kind.

Declarations only; migrations/versions must create exactly this (tests compare the two). Nothing here
opens a connection.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, cast

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Dialect,
    Float,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    TypeDecorator,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class UtcDateTime(TypeDecorator[datetime]):
    """A timezone-aware UTC datetime on every dialect.

    SQLite keeps no offset and PostgreSQL answers in the session's time zone, so values are converted to
    UTC on the way in and tagged UTC on the way out; a naive datetime is refused rather than guessed at.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}: pass a timezone-aware one (UTC)")
        return value.astimezone(UTC)

    def process_result_value(self, value: Any, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


class Base(DeclarativeBase):
    # Named constraints, the same on every dialect, so later migrations (SQLite's batch mode above all)
    # can refer to them by name.
    metadata = MetaData(
        naming_convention={
            "ix": "ix_%(table_name)s_%(column_0_name)s",
            "uq": "uq_%(table_name)s_%(column_0_name)s",
            "ck": "ck_%(table_name)s_%(constraint_name)s",
            "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
            "pk": "pk_%(table_name)s",
        }
    )


class Job(Base):
    __tablename__ = "jobs"
    # The API lists a tenant's jobs newest first (keyset on created_at, id).
    __table_args__ = (Index("ix_jobs_tenant_created_at", "tenant", "created_at"),)

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    model: Mapped[str] = mapped_column(String(200))
    priority: Mapped[str] = mapped_column(String(16))
    # queued, running, succeeded, failed, partial or cancelled; see results.FINISHED_STATES.
    state: Mapped[str] = mapped_column(String(16))
    total: Mapped[int] = mapped_column(Integer)
    done: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    failed: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime())
    started_at: Mapped[datetime | None] = mapped_column(UtcDateTime())
    finished_at: Mapped[datetime | None] = mapped_column(UtcDateTime())
    # Who submitted it: an API key's tenant, or "default" for jobs from Python (infer.delay, client.submit).
    tenant: Mapped[str] = mapped_column(String(64), server_default=text("'default'"))
    # The submitter's own JSON object, returned as given. `metadata` is reserved on declarative classes, so
    # the attribute has another name than the column.
    meta: Mapped[Any] = mapped_column("metadata", JSON(none_as_null=True), nullable=True)


class Result(Base):
    """One row per item of a job; exactly one of output and error is set.

    No foreign key to jobs: write_batch inserts thousands of rows a second and a key would make PostgreSQL
    look up and share-lock the job row for every one; write_batch creates the job row in the same
    transaction instead.
    """

    __tablename__ = "results"

    job_id: Mapped[str] = mapped_column(String(36), primary_key=True)
    item_index: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    item_id: Mapped[str | None] = mapped_column(String(200))
    # none_as_null: an error row stores SQL NULL here, not the JSON text 'null'.
    output: Mapped[Any] = mapped_column(JSON(none_as_null=True), nullable=True)
    error: Mapped[str | None] = mapped_column(Text)
    batch_id: Mapped[int | None] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime())


class Batch(Base):
    """One forward pass of a model: what went in and how long it waited and ran."""

    __tablename__ = "batches"
    __table_args__ = (Index("ix_batches_started_at", "started_at"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    model: Mapped[str] = mapped_column(String(200))
    lane: Mapped[str] = mapped_column(String(64))
    size: Mapped[int] = mapped_column(Integer)
    real_tokens: Mapped[int] = mapped_column(Integer)
    padded_tokens: Mapped[int] = mapped_column(Integer)
    # Queue wait of the batch's oldest item.
    wait_ms: Mapped[float] = mapped_column(Float)
    run_ms: Mapped[float] = mapped_column(Float)
    started_at: Mapped[datetime] = mapped_column(UtcDateTime())
    worker: Mapped[str] = mapped_column(String(200))


class GeneratedTokens(Base):
    """Tokens generated for one item of a generation job: while it runs (reported about once a second by
    the worker running it) and, ``final``, the count of its stored output.

    Its own table, not a column of results: an item has no result row while it runs. Rows are written only
    for models that generate (StepModels), so an embedding job has none.
    """

    __tablename__ = "generated_tokens"

    job_id: Mapped[str] = mapped_column(String(36), primary_key=True)
    item_index: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    tokens: Mapped[int] = mapped_column(Integer)
    # Set with the item's result: the count is then its output's, and no later report changes it.
    final: Mapped[bool] = mapped_column(Boolean)
    updated_at: Mapped[datetime] = mapped_column(UtcDateTime())


class ApiKey(Base):
    """A key of the HTTP API. Only its SHA-256 is kept: keys are 256-bit random tokens, so a plain hash
    cannot be reversed by guessing, and a lookup by hash needs no per-key salt."""

    __tablename__ = "api_keys"
    __table_args__ = (Index("ix_api_keys_key_sha256", "key_sha256", unique=True),)

    id: Mapped[str] = mapped_column(String(16), primary_key=True)  # shown by `keys list`, for `keys revoke`
    key_sha256: Mapped[str] = mapped_column(String(64))
    tenant: Mapped[str] = mapped_column(String(64))
    # An admin key also sees the jobs of the "default" tenant (those submitted from Python).
    admin: Mapped[bool] = mapped_column(Boolean)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime())
    revoked_at: Mapped[datetime | None] = mapped_column(UtcDateTime())


class TunedLimit(Base):
    """Batching limits `batchwork tune --apply` chose for a model on a kind of device, and the largest
    batch that ran out of memory there (the worker's OOM backoff records it).

    One row per (model, device kind); workers on that kind re-read it every BATCHWORK_TUNED_REFRESH_S.
    ``batching`` has BATCHWORK_BATCHING's shape for one model; explicit settings go over it.
    """

    __tablename__ = "tuned_limits"

    model: Mapped[str] = mapped_column(String(200), primary_key=True)
    # "cpu", or "cuda:" and the GPU's name: limits measured on one GPU model hold for its twins only.
    device_kind: Mapped[str] = mapped_column(String(200), primary_key=True)
    batching: Mapped[Any] = mapped_column(JSON(none_as_null=True), nullable=True)
    # What the choice was made for and measured at: bound, memory cap, per-lane p99 and items/s.
    detail: Mapped[Any] = mapped_column(JSON(none_as_null=True), nullable=True)
    tuned_at: Mapped[datetime | None] = mapped_column(UtcDateTime())
    tuned_by: Mapped[str | None] = mapped_column(String(200))
    oom_batch_size: Mapped[int | None] = mapped_column(Integer)
    oom_at: Mapped[datetime | None] = mapped_column(UtcDateTime())
    oom_worker: Mapped[str | None] = mapped_column(String(200))


class File(Base):
    """A file of the OpenAI-compatible surface (``/v1/files``): an uploaded batch input, or a batch's output
    or error file. Its bytes are rows of ``file_chunks``; the row appears once every chunk is written."""

    __tablename__ = "files"
    __table_args__ = (Index("ix_files_tenant_created_at", "tenant", "created_at"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # "file-" and 32 hex digits
    tenant: Mapped[str] = mapped_column(String(64))
    filename: Mapped[str] = mapped_column(String(255))
    purpose: Mapped[str] = mapped_column(String(32))  # batch (uploaded) or batch_output (written)
    bytes: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime())
    # A batch output's end (the batch's output_expires_after); past it the file is gone (404), its bytes
    # deleted by the next API process that sweeps.
    expires_at: Mapped[datetime | None] = mapped_column(UtcDateTime())


class FileChunk(Base):
    """A file's bytes, in pieces of at most a few MiB (PostgreSQL bytea, SQLite blob), in ``seq`` order."""

    __tablename__ = "file_chunks"

    file_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    data: Mapped[bytes] = mapped_column(LargeBinary)


class OpenAIBatch(Base):
    """A batch of the OpenAI-compatible surface (``/v1/batches``): an input file run as one job per model.

    Any API process advances it (validating -> in_progress -> finalizing -> completed, or failed, expired,
    cancelling -> cancelled) under a lease (``claimed_until``), so one that dies mid-step is resumed by the
    next. Its jobs' ids are derived from its id and model, so a step done twice finds the same jobs.
    """

    __tablename__ = "openai_batches"
    __table_args__ = (
        Index("ix_openai_batches_tenant_created_at", "tenant", "created_at"),
        Index("ix_openai_batches_status", "status"),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # "batch_" and 32 hex digits
    tenant: Mapped[str] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16))
    endpoint: Mapped[str] = mapped_column(String(64))
    input_file_id: Mapped[str] = mapped_column(String(64))
    completion_window: Mapped[str] = mapped_column(String(16))
    meta: Mapped[Any] = mapped_column("metadata", JSON(none_as_null=True), nullable=True)
    # {model: job id} once the requests are enqueued.
    jobs: Mapped[Any] = mapped_column(JSON(none_as_null=True), nullable=True)
    total: Mapped[int] = mapped_column(Integer, server_default=text("0"))  # request lines
    total_items: Mapped[int] = mapped_column(Integer, server_default=text("0"))  # model items (inputs)
    completed: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    failed: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    errors: Mapped[Any] = mapped_column(JSON(none_as_null=True), nullable=True)  # errors.data[] at validation
    # How far the output and error files are written while the jobs run (api.batch_output.Cursor), committed
    # with the bytes it covers; ``completed``/``failed`` count the lines written.
    written: Mapped[Any] = mapped_column(JSON(none_as_null=True), nullable=True)
    output_expires_s: Mapped[int | None] = mapped_column(Integer)  # output_expires_after.seconds
    output_file_id: Mapped[str | None] = mapped_column(String(64))
    error_file_id: Mapped[str | None] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(UtcDateTime())
    expires_at: Mapped[datetime] = mapped_column(UtcDateTime())
    in_progress_at: Mapped[datetime | None] = mapped_column(UtcDateTime())
    finalizing_at: Mapped[datetime | None] = mapped_column(UtcDateTime())
    completed_at: Mapped[datetime | None] = mapped_column(UtcDateTime())
    failed_at: Mapped[datetime | None] = mapped_column(UtcDateTime())
    expired_at: Mapped[datetime | None] = mapped_column(UtcDateTime())
    cancelling_at: Mapped[datetime | None] = mapped_column(UtcDateTime())
    cancelled_at: Mapped[datetime | None] = mapped_column(UtcDateTime())
    # The API process advancing it, until when (a step that outlives its lease renews it).
    claimed_by: Mapped[str | None] = mapped_column(String(64))
    claimed_until: Mapped[datetime | None] = mapped_column(UtcDateTime())


metadata = Base.metadata
# The store writes with Core statements (bulk, dialect-specific ON CONFLICT), so it wants the Tables.
jobs = cast(Table, Job.__table__)
results = cast(Table, Result.__table__)
batches = cast(Table, Batch.__table__)
generated_tokens = cast(Table, GeneratedTokens.__table__)
api_keys = cast(Table, ApiKey.__table__)
tuned_limits = cast(Table, TunedLimit.__table__)
files = cast(Table, File.__table__)
file_chunks = cast(Table, FileChunk.__table__)
openai_batches = cast(Table, OpenAIBatch.__table__)
