"""Bodies of the OpenAI-compatible routes, shaped as OpenAI's (openai-python's types) so its client parses
them unchanged. The boundary only: the requests are checked by worker.openai_compat.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

BatchStatus = Literal[
    "validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"
]


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str = Field(description="batch (uploaded) or batch_output (a batch's output or error file)")
    status: Literal["processed"] = "processed"
    status_details: str | None = None
    expires_at: int | None = None


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    has_more: bool
    first_id: str | None
    last_id: str | None


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool


class ExpiresAfter(BaseModel):
    """OpenAI's expiration policy of a batch's output files: ``seconds`` after the file's ``created_at``."""

    model_config = ConfigDict(extra="forbid")

    anchor: Literal["created_at"]
    seconds: int = Field(ge=3600, le=2_592_000, description="1 hour to 30 days, as OpenAI's")


class BatchCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_file_id: str = Field(max_length=64, description="a file uploaded with purpose=batch")
    endpoint: Literal["/v1/embeddings", "/v1/completions", "/v1/chat/completions"]
    completion_window: str = Field(
        default="24h", max_length=16, description='"24h" (or a shorter "Ns", "Nm", "Nh"): the deadline'
    )
    metadata: dict[str, str] | None = Field(default=None, description="at most 16 keys")
    output_expires_after: ExpiresAfter | None = Field(
        default=None, description="when the output and error files expire (then 404), from their creation"
    )


class RequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


class BatchError(BaseModel):
    code: str | None
    message: str | None
    line: int | None = Field(description="the input file's line, from 1")
    param: str | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchError]


class BatchObject(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: BatchErrors | None
    input_file_id: str
    completion_window: str
    status: BatchStatus
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    in_progress_at: int | None
    expires_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    request_counts: RequestCounts
    metadata: dict[str, str] | None


class BatchList(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchObject]
    has_more: bool
    first_id: str | None
    last_id: str | None


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(max_length=200, description="an embed model from GET /v1/models (or noop)")
    input: str | list[str] | list[int] | list[list[int]] = Field(
        description="a string, a list of strings, or token arrays (ids of the model's own tokenizer)"
    )
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: int | None = Field(default=None, ge=1, description="keep the first d numbers, renormalized")
    user: str | None = Field(default=None, max_length=256)


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
