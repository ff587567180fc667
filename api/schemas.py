"""The API's request and response bodies, as pydantic models (the boundary; nothing inside uses them).

Inputs are not checked here: the model registry checks them through the client, as for every producer.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from worker.store.values import JobState, JobStatus


class JobRequest(BaseModel):
    """A job: the model's name and its inputs (the same items as one line each of `batchwork run`)."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="a model name from GET /v1/models")
    inputs: list[Any] = Field(description='e.g. ["text", {"id": "doc-1", "text": "..."}]')
    priority: str = Field(default="normal", description="high, normal or bulk")
    deadline_s: float | None = Field(default=None, description="items not started by then end as expired")
    metadata: dict[str, Any] | None = Field(
        default=None, description="your own JSON object, returned as given"
    )


class Counts(BaseModel):
    total: int
    done: int
    failed: int
    errors: dict[str, int] | None = Field(
        default=None,
        description="failed items by kind (an error's text before its first ':'); in GET /v1/jobs/{id}",
    )


class Job(BaseModel):
    id: str
    model: str
    priority: str
    state: JobState
    counts: Counts
    error: str | None = Field(description="why the whole job failed, when it did")
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    metadata: Any = Field(description="the metadata given at submit")
    generated_tokens: int | None = Field(default=None, description="generation jobs: tokens so far")

    @classmethod
    def of(cls, status: JobStatus, errors: dict[str, int] | None = None) -> Job:
        return cls(
            id=status.job_id,
            model=status.model,
            priority=status.priority,
            state=status.state,
            counts=Counts(total=status.total, done=status.done, failed=status.failed, errors=errors),
            error=status.error,
            created_at=status.created_at,
            started_at=status.started_at,
            finished_at=status.finished_at,
            metadata=status.metadata,
            generated_tokens=status.generated_tokens,
        )


class JobList(BaseModel):
    jobs: list[Job]
    next_cursor: str | None = Field(description="pass as ?cursor= for the next page; null on the last")


class ModelInfo(BaseModel):
    name: str
    description: str
    max_batch_size: int
    max_wait_ms: float


class Health(BaseModel):
    status: Literal["ok", "unavailable"]
    broker: str
    database: str


class ErrorBody(BaseModel):
    detail: str = Field(description="one line saying what went wrong and what to do")


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI entries for the error answers a route can give, all of one shape."""
    meaning = {
        401: "missing, unknown or revoked key",
        404: "no such job (or file, or batch) for this key's tenant",
        409: "the file is the input of a batch still running",
        413: "body too large",
        422: "invalid request",
        429: "too many items (per job or unfinished for the tenant); see Retry-After",
        503: "the broker's queues are full (or no worker answered in time); see Retry-After",
    }
    return {code: {"model": ErrorBody, "description": meaning[code]} for code in codes}
