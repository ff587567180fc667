"""The /v1 routes: submit (JSON or NDJSON), read, list, stream results, cancel, and the models.

Every route that names a job looks it up within the caller's tenants, so another tenant's job is 404, never
403. Database and broker calls run on the thread pool, never on the event loop.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections import deque
from itertools import chain
from typing import Annotated
from uuid import uuid4

from fastapi import APIRouter, Depends, HTTPException, Path, Query, Request
from fastapi.responses import StreamingResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect

from api import limits
from api.auth import backend, caller
from api.backend import Backend
from api.checking import Checker
from api.schemas import Job, JobList, JobRequest, ModelInfo, error_responses
from api.spool import CheckedPiece, NdjsonSpool, Piece
from worker.bounds import MAX_COUNT
from worker.calls import NewJob, expiry
from worker.jobs import RedisMessages
from worker.models.registry import served_models
from worker.store.api_keys import ApiKey
from worker.store.catalog import InvalidCursor
from worker.store.values import JobState, JobStatus

router = APIRouter(prefix="/v1", responses=error_responses(401, 422))

Caller = Annotated[ApiKey, Depends(caller)]
Served = Annotated[Backend, Depends(backend)]
# Any other string names no job: 404, found without a query (the store never sees it).
JobId = Annotated[
    str, Path(description="a job id from POST /v1/jobs (a UUID)", json_schema_extra={"format": "uuid"})
]

# NDJSON arrives in socket-sized pieces (~64 KiB), written to the body's file; it is checked 256 KiB at a
# time (one hop to a checker each, naming a byte range of the file: ~4,000 short lines): small enough that
# the checks of the body's end, which the answer waits for, are short, large enough that a hop costs little
# beside its check.
FEED_BYTES = 2**18
# Pieces in flight per checking process: one being checked, one waiting, so none idles while the event
# loop spools a verdict.
PIECES_PER_CHECKER = 2

_SUBMIT_BODY = {
    "required": True,
    "content": {
        "application/json": {"schema": JobRequest.model_json_schema()},
        limits.NDJSON: {
            "schema": {"type": "string", "description": "one input a line, as `batchwork run` reads; ?model="}
        },
    },
}


# What a client (and schemathesis' stateful phase) can do next with a job it was given.
_JOB_LINKS = {
    name: {"operationId": operation, "parameters": {"job_id": "$response.body#/id"}}
    for name, operation in (("GetJob", "get_job"), ("GetResults", "job_results"), ("Cancel", "cancel_job"))
}


@router.post(
    "/jobs",
    status_code=202,
    response_model=Job,
    openapi_extra={"requestBody": _SUBMIT_BODY},
    responses={
        202: {"description": "the job, queued", "links": _JOB_LINKS},
        **error_responses(413, 429, 503),
    },
)
async def submit_job(
    request: Request,
    key: Caller,
    served: Served,
    model: Annotated[str | None, Query(description="NDJSON bodies: the model")] = None,
    priority: Annotated[str, Query(description="NDJSON bodies: high, normal or bulk")] = "normal",
    deadline_s: Annotated[float | None, Query(description="NDJSON bodies: see JobRequest")] = None,
) -> Job:
    """Submit a job: a JSON JobRequest, or (large jobs) NDJSON with ``?model=``, read as a stream."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    try:
        if content_type == limits.NDJSON:
            if model is None:
                raise HTTPException(422, "an NDJSON body needs ?model=NAME")
            status = await _submit_ndjson(request, served, key.tenant, model, priority, deadline_s)
        else:
            job = _parse_job_request(await request.body())
            status = await run_in_threadpool(_submit_json, served, key.tenant, job)
    except ClientDisconnect:  # nobody is left to read the answer; the log and the metrics get a 400
        raise HTTPException(400, "the client went away before the body ended: nothing was enqueued") from None
    return Job.of(status)


def _parse_job_request(body: bytes) -> JobRequest:
    try:
        return JobRequest.model_validate_json(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "body"
        raise HTTPException(422, f"{where}: {first['msg']} (send a JSON JobRequest, or NDJSON)") from None


def _submit_json(served: Backend, tenant: str, job: JobRequest) -> JobStatus:
    limits.admit(served, tenant, len(job.inputs))
    job_id = served.client.submit(
        job.model, job.inputs, job.priority, job.deadline_s, tenant=tenant, metadata=job.metadata
    )
    return _status(served, job_id, [tenant])


async def _submit_ndjson(
    request: Request, served: Backend, tenant: str, model: str, priority: str, deadline_s: float | None
) -> JobStatus:
    # Is there room at all? Asked while the body's first pieces arrive (its SQL and Redis reads took as long
    # as a tenth of the upload): a refusal ends the upload as soon as it is known.
    admitted = asyncio.ensure_future(run_in_threadpool(limits.admit, served, tenant, 0))
    expires_at = expiry(deadline_s)
    try:
        with tempfile.NamedTemporaryFile(prefix="batchwork-body-") as file:  # named: the checks open it
            spool = NdjsonSpool(model, priority, served.settings, file)
            checker = request.app.state.checker
            try:
                total = await _spool_body(request, spool, checker, admitted)
            except Exception:
                await asyncio.wait([admitted])  # a refusal comes first, as when it was asked before the body
                admitted.result()
                raise
            return await run_in_threadpool(_publish_spool, served, checker, tenant, spool, total, expires_at)
    finally:
        if not admitted.cancel() and not admitted.cancelled():
            admitted.exception()  # it had ended: read, so asyncio does not log it


async def _spool_body(
    request: Request, spool: NdjsonSpool, checker: Checker, admitted: asyncio.Future[None]
) -> int:
    """Cut the body into pieces as it arrives, check them ``checker.width`` at a time while reading on, and
    spool each in body order as its check ends; the number of items. A refusal of ``admitted`` is raised as
    soon as it is seen, and the items are counted only once it was admitted."""
    checks: deque[asyncio.Task[CheckedPiece]] = deque()
    in_flight = checker.width * PIECES_PER_CHECKER

    def check(piece: Piece | None) -> None:
        if piece is not None:
            checks.append(asyncio.ensure_future(checker.check(piece, spool.model, spool.priority)))

    received = bytearray()
    try:
        async for data in request.stream():
            if admitted.done():
                admitted.result()
            received += data
            if len(received) >= FEED_BYTES:
                check(spool.piece(received))
                received.clear()
                while checks and (checks[0].done() or len(checks) >= in_flight):
                    spool.add(await checks.popleft())
        check(spool.piece(received))
        check(spool.last_piece())
        await admitted
        while checks:
            spool.add(await checks.popleft())
        return spool.finish()
    finally:
        for task in checks:  # the body was refused or broke off: the checks still in flight are dropped
            if not task.cancel() and not task.cancelled():
                task.exception()  # it had ended: read, so asyncio does not log it


def _publish_spool(
    served: Backend, checker: Checker, tenant: str, spool: NdjsonSpool, total: int, expires_at: float | None
) -> JobStatus:
    """Record the job, then send its messages: from the checking processes, each a run of the parts, where
    there are some and the broker is Redis (encoding is Python: the API alone would send them one by one)."""
    limits.admit(served, tenant, total)
    call = NewJob.header(str(uuid4()), spool.model, spool.priority, total, expires_at)
    served.jobs.record(call, tenant=tenant)
    if checker.processes and isinstance(served.jobs.messages, RedisMessages):
        served.jobs.publish_by(call, lambda: checker.send(spool, call))
    else:
        served.jobs.publish(call, spool.parts())
    return _status(served, call.job_id, [tenant])


@router.get("/jobs", response_model=JobList)
def list_jobs(
    key: Caller,
    served: Served,
    state: JobState | None = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    cursor: Annotated[str | None, Query(max_length=200, description="next_cursor of the last page")] = None,
) -> JobList:
    """The caller's jobs, newest first; follow ``next_cursor`` for older ones."""
    try:
        page = served.jobs.page(key.tenants, state=state, limit=limit, cursor=cursor)
    except InvalidCursor as exc:
        raise HTTPException(422, str(exc)) from None
    return JobList(jobs=[Job.of(status) for status in page.jobs], next_cursor=page.next_cursor)


@router.get("/jobs/{job_id}", response_model=Job, responses=error_responses(404), operation_id="get_job")
def get_job(job_id: JobId, key: Caller, served: Served) -> Job:
    """State, counts (with failed items by error kind), timestamps and metadata."""
    status = _status(served, job_id, key.tenants)
    errors = served.catalog.error_kinds(job_id) if status.failed else {}
    return Job.of(status, errors)


@router.get(
    "/jobs/{job_id}/results",
    operation_id="job_results",
    response_class=StreamingResponse,
    responses={
        200: {"content": {limits.NDJSON: {"schema": {"type": "string"}}}, "description": "one line per item"},
        **error_responses(404),
    },
)
def job_results(
    job_id: JobId,
    key: Caller,
    served: Served,
    after: Annotated[int, Query(ge=-1, le=MAX_COUNT, description="only items of index above this")] = -1,
    limit: Annotated[int | None, Query(ge=1, le=MAX_COUNT, description="at most this many lines")] = None,
) -> StreamingResponse:
    """Stored results in index order as NDJSON (``index``, ``id``, ``output`` or ``error``), streamed.

    The job and the first lines are read before the answer starts: a database that fails then is a 503, not
    a body broken after its 200."""
    _status(served, job_id, key.tenants)
    lines = served.jobs.result_lines(job_id, after=after, limit=limit)
    first = next(lines, b"")
    return StreamingResponse(chain([first], lines), media_type=limits.NDJSON)


@router.post(
    "/jobs/{job_id}/cancel", response_model=Job, responses=error_responses(404), operation_id="cancel_job"
)
def cancel_job(job_id: JobId, key: Caller, served: Served) -> Job:
    """Cancel a queued or running job (a finished one stays as it is); its waiting items end cancelled."""
    _status(served, job_id, key.tenants)
    served.jobs.cancel(job_id, tenants=key.tenants)
    return Job.of(_status(served, job_id, key.tenants))


@router.get("/models", response_model=list[ModelInfo])
def list_models(key: Caller, served: Served) -> list[ModelInfo]:
    """The models this deployment serves (BATCHWORK_MODELS), with their default batch size N and wait T."""
    return [
        ModelInfo(**row._asdict()) for row in served_models(served.settings) if not isinstance(row, Exception)
    ]


def _status(served: Backend, job_id: str, tenants: list[str] | tuple[str, ...]) -> JobStatus:
    """The job as the port finds it (SQL, then the broker's record of an ``infer.delay`` job): 404 when it
    is unknown or another tenant's."""
    status = served.jobs.find(job_id, tenants)
    if status is None:
        raise HTTPException(404, f"no job {job_id}")
    return status
