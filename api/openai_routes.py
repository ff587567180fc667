"""The OpenAI-compatible routes: /v1/files, /v1/batches and /v1/embeddings, for the official `openai` client
with ``base_url="http://HOST:8000/v1"`` and a batchwork key as ``api_key``.

Files and batches belong to the key's tenant (another tenant's answers 404, as jobs do). File bytes are
chunk rows in the SQL store; batches are rows advanced by ``BatchRunner`` in every API process.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Annotated, Any

from fastapi import APIRouter, Depends, File, Form, HTTPException, Query, Request, UploadFile
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from api import limits
from api.auth import backend, caller
from api.backend import Backend
from api.batch_runner import BatchRunner, unix
from api.embeddings import ResultWaiter
from api.openai_schemas import (
    BatchCreate,
    BatchErrors,
    BatchList,
    BatchObject,
    EmbeddingRequest,
    EmbeddingResponse,
    ExpiresAfter,
    FileDeleted,
    FileList,
    FileObject,
    RequestCounts,
)
from api.schemas import error_responses
from api.uploads import CACHED_BYTES, UploadCache
from worker.calls import NewJob
from worker.models.registry import model_class
from worker.openai_compat.requests import EMBEDDINGS, RequestError, parse_request
from worker.openai_compat.responses import OutputError, embeddings_body
from worker.openai_compat.tokens import count_tokens, detokenize
from worker.store.api_keys import ApiKey
from worker.store.files import BatchStore, FileRecord, FileStore, utcnow

router = APIRouter(prefix="/v1", responses=error_responses(401, 422), tags=["openai"])

Caller = Annotated[ApiKey, Depends(caller)]
Served = Annotated[Backend, Depends(backend)]

# File and batch ids are ours ("file-...", "batch_..."): anything else is no such object (never sent to the
# database, which refuses some characters outright, NUL above all).
ID_PATTERN = r"^[A-Za-z0-9_\-]{1,64}$"
_ID = re.compile(r"[A-Za-z0-9_\-]{1,64}")
READ_BYTES = 2**20  # an upload is copied to the store a MiB at a time
MAX_METADATA_KEYS = 16
_WINDOW = re.compile(r"^([1-9][0-9]{0,5})([smh])$")
_SECONDS = {"s": 1, "m": 60, "h": 3600}
MAX_WINDOW_S = 24 * 3600


class OpenAISurface:
    """What the routes share: the stores, the batch runner and the embeddings waiter."""

    def __init__(self, served: Backend) -> None:
        store = served.store
        self.served = served
        self.files = FileStore(store.engine, store.url)
        self.batches = BatchStore(store.engine, store.url)
        self.uploads = UploadCache(served.settings)
        self.runner = BatchRunner(served, self.files, self.batches, self.uploads)
        self.waiter = ResultWaiter(store)

    def start(self) -> None:
        self.runner.start()

    def close(self) -> None:
        self.runner.close()
        self.uploads.close()


def surface(request: Request) -> OpenAISurface:
    return request.app.state.openai  # type: ignore[no-any-return]


Surface = Annotated[OpenAISurface, Depends(surface)]


# -- files ------------------------------------------------------------------------------------------


@router.post("/files", response_model=FileObject, responses=error_responses(413))
async def upload_file(
    key: Caller,
    oai: Surface,
    file: Annotated[UploadFile, File(description="JSONL, one request a line")],
    purpose: Annotated[str, Form(description='"batch"')],
) -> FileObject:
    """Upload a batch input file (multipart, purpose=batch), at most BATCHWORK_API_MAX_FILE_BYTES."""
    settings = oai.served.settings
    if purpose != "batch":
        raise HTTPException(422, f"purpose must be 'batch', not {purpose[:40]!r}")
    size = file.size if file.size is not None else 0
    if size > settings.api_max_file_bytes:
        raise HTTPException(413, _file_too_large(settings.api_max_file_bytes))
    name = "".join(c for c in (file.filename or "") if c.isprintable())[:255] or "upload.jsonl"
    record = FileRecord(f"file-{uuid.uuid4().hex}", key.tenant, name, "batch", 0, utcnow())
    stored = await run_in_threadpool(_store, oai, record, file.file, settings.api_max_file_bytes)
    return file_object(stored)


def _store(oai: OpenAISurface, record: FileRecord, handle: Any, limit: int) -> FileRecord:
    """Write the upload to the store; a small one is also kept here, its check begun meanwhile."""
    head = handle.read(min(limit, CACHED_BYTES) + 1)
    if len(head) > CACHED_BYTES or len(head) > limit:  # large: streamed to the store, checked later
        return oai.files.create(record, _read(handle, limit, head))
    oai.uploads.put(record.id, head)
    try:
        return oai.files.create(record, [head])
    except BaseException:
        oai.uploads.drop(record.id)
        raise


def _read(handle: Any, limit: int, head: bytes = b"") -> Iterator[bytes]:
    total = len(head)
    if total > limit:
        raise HTTPException(413, _file_too_large(limit))
    yield head
    while data := handle.read(READ_BYTES):
        total += len(data)
        if total > limit:
            raise HTTPException(413, _file_too_large(limit))
        yield data


def _file_too_large(limit: int) -> str:
    return f"a file holds at most {limit} bytes (BATCHWORK_API_MAX_FILE_BYTES)"


@router.get("/files", response_model=FileList)
def list_files(
    key: Caller,
    oai: Surface,
    purpose: Annotated[str | None, Query(pattern=r"^[a-z_\-]{1,32}$")] = None,
    after: Annotated[str | None, Query(pattern=ID_PATTERN)] = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
    order: Annotated[str, Query(pattern="^(asc|desc)$")] = "desc",
) -> FileList:
    """The tenant's files (uploads, and batches' output and error files), newest first by default."""
    page = oai.files.page(key.tenants, purpose, after, limit, order == "desc")
    data = [file_object(record) for record in page.rows]
    return FileList(
        data=data,
        has_more=page.has_more,
        first_id=data[0].id if data else None,
        last_id=data[-1].id if data else None,
    )


@router.get("/files/{file_id}", response_model=FileObject, responses=error_responses(404))
def get_file(file_id: str, key: Caller, oai: Surface) -> FileObject:
    return file_object(_file(oai, file_id, key))


@router.get(
    "/files/{file_id}/content",
    response_class=StreamingResponse,
    responses={
        200: {"content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}},
        **error_responses(404),
    },
)
def file_content(file_id: str, key: Caller, oai: Surface) -> StreamingResponse:
    """The file's bytes, streamed."""
    record = _file(oai, file_id, key)
    headers = {"Content-Length": str(record.bytes)}
    return StreamingResponse(
        oai.files.content(file_id), media_type="application/octet-stream", headers=headers
    )


@router.delete("/files/{file_id}", response_model=FileDeleted, responses=error_responses(404, 409))
def delete_file(file_id: str, key: Caller, oai: Surface) -> FileDeleted:
    _file(oai, file_id, key)
    if oai.batches.active_using(file_id):
        raise HTTPException(409, f"file {file_id} is the input of a batch still running: cancel it first")
    oai.uploads.drop(file_id)
    return FileDeleted(id=file_id, deleted=oai.files.delete(file_id, key.tenants))


def _file(oai: OpenAISurface, file_id: str, key: ApiKey) -> FileRecord:
    record = oai.files.get(file_id, key.tenants) if _ID.fullmatch(file_id) else None
    if record is None:
        raise HTTPException(404, f"no file {file_id[:80]}")
    return record


def file_object(record: FileRecord) -> FileObject:
    return FileObject(
        id=record.id,
        bytes=record.bytes,
        created_at=int(record.created_at.timestamp()),
        filename=record.filename,
        purpose=record.purpose,
        expires_at=unix(record.expires_at),
    )


# -- batches ----------------------------------------------------------------------------------------


@router.post("/batches", response_model=BatchObject, responses=error_responses(404, 429, 503))
def create_batch(body: BatchCreate, key: Caller, oai: Surface) -> BatchObject:
    """Create a batch from an uploaded file; it is checked (``validating``), then runs. A bad file is a batch
    that ends ``failed`` with ``errors`` naming the lines, not a 4xx."""
    window_s = _window_s(body.completion_window)
    _check_metadata(body.metadata)
    output_expires_s = _output_expires_s(body.output_expires_after)
    if not _ID.fullmatch(body.input_file_id) or oai.files.get(body.input_file_id, [key.tenant]) is None:
        raise HTTPException(404, f"no file {body.input_file_id}")
    limits.admit(oai.served, key.tenant, 0)
    now = utcnow()
    row: dict[str, Any] = {
        "id": f"batch_{uuid.uuid4().hex}",
        "tenant": key.tenant,
        "status": "validating",
        "endpoint": body.endpoint,
        "input_file_id": body.input_file_id,
        "completion_window": body.completion_window,
        "metadata": body.metadata,
        "created_at": now,
        "expires_at": now + timedelta(seconds=window_s),
        "output_expires_s": output_expires_s,
    }
    oai.batches.create(row)
    oai.runner.kick()
    return _batch(oai, row["id"], key)


def _window_s(window: str) -> int:
    match = _WINDOW.fullmatch(window)  # not match: "$" lets a final newline by
    seconds = int(match[1]) * _SECONDS[match[2]] if match else 0
    if not 0 < seconds <= MAX_WINDOW_S:
        raise HTTPException(
            422, f'completion_window must be "24h" (or a shorter "Ns", "Nm", "Nh"), not {window!r}'
        )
    return seconds


def _output_expires_s(value: ExpiresAfter | None) -> int | None:
    return None if value is None else value.seconds


def _check_metadata(metadata: dict[str, str] | None) -> None:
    if metadata is None:
        return
    if len(metadata) > MAX_METADATA_KEYS:
        raise HTTPException(422, f"metadata holds at most {MAX_METADATA_KEYS} keys")
    for name, value in metadata.items():
        if len(name) > 64 or len(value) > 512:
            raise HTTPException(422, "metadata keys are at most 64 characters, values at most 512")


@router.get("/batches", response_model=BatchList)
def list_batches(
    key: Caller,
    oai: Surface,
    after: Annotated[str | None, Query(pattern=ID_PATTERN)] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> BatchList:
    """The tenant's batches, newest first; pass the last id as ``after`` for the next page."""
    page = oai.batches.page(key.tenants, after, limit)
    data = [batch_object(oai, row) for row in page.rows]
    return BatchList(
        data=data,
        has_more=page.has_more,
        first_id=data[0].id if data else None,
        last_id=data[-1].id if data else None,
    )


@router.get("/batches/{batch_id}", response_model=BatchObject, responses=error_responses(404))
def get_batch(batch_id: str, key: Caller, oai: Surface) -> BatchObject:
    """The batch, with live request_counts while it runs."""
    return _batch(oai, batch_id, key)


@router.post("/batches/{batch_id}/cancel", response_model=BatchObject, responses=error_responses(404))
def cancel_batch(batch_id: str, key: Caller, oai: Surface) -> BatchObject:
    """validating or in_progress -> cancelling -> cancelled (finished lines stay in the output file)."""
    _batch(oai, batch_id, key)  # 404 first, for an id that is not a batch of this tenant
    if oai.batches.request_cancel(batch_id, key.tenants):
        oai.runner.kick()
    return _batch(oai, batch_id, key)


def _batch(oai: OpenAISurface, batch_id: str, key: ApiKey) -> BatchObject:
    row = oai.batches.get(batch_id, key.tenants) if _ID.fullmatch(batch_id) else None
    if row is None:
        raise HTTPException(404, f"no batch {batch_id[:80]}")
    return batch_object(oai, row)


def batch_object(oai: OpenAISurface, row: dict[str, Any]) -> BatchObject:
    return BatchObject(
        id=row["id"],
        endpoint=row["endpoint"],
        errors=BatchErrors(data=row["errors"]) if row["errors"] else None,
        input_file_id=row["input_file_id"],
        completion_window=row["completion_window"],
        status=row["status"],
        output_file_id=row["output_file_id"],
        error_file_id=row["error_file_id"],
        created_at=int(row["created_at"].timestamp()),
        expires_at=unix(row["expires_at"]),
        in_progress_at=unix(row["in_progress_at"]),
        finalizing_at=unix(row["finalizing_at"]),
        completed_at=unix(row["completed_at"]),
        failed_at=unix(row["failed_at"]),
        expired_at=unix(row["expired_at"]),
        cancelling_at=unix(row["cancelling_at"]),
        cancelled_at=unix(row["cancelled_at"]),
        request_counts=_counts(row),
        metadata=row["metadata"],
    )


def _counts(row: dict[str, Any]) -> RequestCounts:
    """Lines, not inputs: a line counts as completed or failed once every input of it has an outcome and
    it is written to the output or error file (in input order, as its jobs' results are stored)."""
    return RequestCounts(total=row["total"], completed=row["completed"], failed=row["failed"])


# -- embeddings -------------------------------------------------------------------------------------


@router.post("/embeddings", response_model=EmbeddingResponse, responses=error_responses(429, 503))
async def embeddings(body: EmbeddingRequest, key: Caller, oai: Surface) -> Any:
    """OpenAI's embeddings, synchronous: the inputs ride the ``high`` lane, so concurrent requests share the
    device's batches."""
    settings = oai.served.settings
    try:
        request = parse_request(EMBEDDINGS, body.model_dump(exclude_none=True), settings, detokenize)
    except RequestError as exc:
        raise HTTPException(422, f"{exc.param or 'body'}: {exc.message}") from None
    call = NewJob(
        str(uuid.uuid4()), request.model, request.items, "high", 0, len(request.items), None, time.time()
    )
    await run_in_threadpool(_enqueue, oai, key.tenant, call)
    outcomes = await oai.waiter.wait(call.job_id, call.total, settings.api_embeddings_timeout_s)
    if outcomes is None:
        await run_in_threadpool(oai.served.jobs.cancel, call.job_id)
        raise limits.refuse(
            503, f"no worker stored these embeddings within {settings.api_embeddings_timeout_s:g} s", settings
        )
    errors = [error for _, error in outcomes if error is not None]
    if errors:
        status = 422 if errors[0].startswith("invalid input") else 500
        raise HTTPException(status, errors[0].splitlines()[0])
    cls = model_class(request.model, settings)
    try:
        return embeddings_body(
            request, [output for output, _ in outcomes], lambda texts: count_tokens(cls, texts)
        )
    except OutputError as exc:
        raise HTTPException(422, str(exc)) from None


def _enqueue(oai: OpenAISurface, tenant: str, call: NewJob) -> None:
    limits.admit(oai.served, tenant, call.total)
    oai.served.jobs.enqueue(call, tenant=tenant)
