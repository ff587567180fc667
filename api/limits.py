"""What the API refuses before it enqueues: bodies too large (413), too many items for one job or for a
tenant's unfinished work (429), and work while the broker's queues are over their bound (503).

429 and 503 carry Retry-After so producers back off instead of growing Redis without limit. The checks
before a submit are advisory under races (two submits may pass at once); the bounds are soft by that much.
"""

from __future__ import annotations

from typing import Any

from fastapi import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.backend import Backend
from worker.settings import Settings

NDJSON = "application/x-ndjson"
MULTIPART = "multipart/form-data"
MULTIPART_ENVELOPE_BYTES = 64 * 2**10
# The two routes that take a larger body than JSON: NDJSON, spooled to disk as it streams, and a file
# upload. Any other body, whatever its Content-Type says, is read whole into memory: the JSON limit.
LARGE_BODIES = {("/v1/jobs", NDJSON), ("/v1/files", MULTIPART)}


def refuse(status: int, detail: str, settings: Settings) -> HTTPException:
    return HTTPException(status, detail, headers={"Retry-After": str(settings.api_retry_after_s)})


def check_job_size(items: int, settings: Settings) -> None:
    if items > settings.max_items_per_job:
        raise refuse(
            429,
            f"a job holds at most {settings.max_items_per_job} items (BATCHWORK_MAX_ITEMS_PER_JOB)",
            settings,
        )


def admit(backend: Backend, tenant: str, items: int) -> None:
    """Raise 429 or 503 when ``items`` more of ``tenant``'s would pass a bound (0: is there room at all?)."""
    settings = backend.settings
    check_job_size(items, settings)
    unfinished = backend.catalog.unfinished_items(tenant)
    if unfinished + items > settings.api_max_tenant_items:
        raise refuse(
            429,
            f"tenant {tenant!r} has {unfinished} unfinished items; at most {settings.api_max_tenant_items} "
            "may wait (BATCHWORK_API_MAX_TENANT_ITEMS): retry when some have finished",
            settings,
        )
    depth = sum(backend.queue_depth().values())
    if depth > settings.api_max_queue_depth:
        raise refuse(
            503,
            f"the broker holds {depth} waiting messages, over BATCHWORK_API_MAX_QUEUE_DEPTH "
            f"({settings.api_max_queue_depth}): retry later",
            settings,
        )


class BodyLimit:
    """413 for a body over the limit of its kind, by its Content-Length at once, or while it streams in.

    Starlette and FastAPI read any body whole; this stops a chunked upload at the limit. NDJSON bodies are
    spooled to disk, so they may be larger than JSON ones, which are held in memory.
    """

    def __init__(self, app: ASGIApp, settings: Settings) -> None:
        self.app = app
        self.settings = settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        limit = self._limit(scope["path"], headers.get(b"content-type", b""))
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > limit:
            await _send_413(send, limit)
            return
        await self.app(scope, _counting(receive, limit), send)

    def _limit(self, path: str, content_type: bytes) -> int:
        kind = content_type.split(b";")[0].strip().decode("latin-1").lower()
        if (path.rstrip("/"), kind) not in LARGE_BODIES:
            return self.settings.api_max_body_bytes
        if kind == NDJSON:
            return self.settings.api_max_ndjson_bytes
        return self.settings.api_max_file_bytes + MULTIPART_ENVELOPE_BYTES  # the file and its envelope


def _counting(receive: Receive, limit: int) -> Receive:
    received = 0

    async def counted() -> Message:
        nonlocal received
        message = await receive()
        received += len(message.get("body", b""))
        if received > limit:
            # FastAPI passes an HTTPException raised while reading the body through as the answer.
            raise HTTPException(413, _too_large(limit))
        return message

    return counted


def _too_large(limit: int) -> str:
    return (
        f"request body over {limit} bytes "
        "(BATCHWORK_API_MAX_BODY_BYTES / BATCHWORK_API_MAX_NDJSON_BYTES / BATCHWORK_API_MAX_FILE_BYTES)"
    )


async def _send_413(send: Send, limit: int) -> None:
    body = b'{"detail":"' + _too_large(limit).encode() + b'"}'
    start: dict[str, Any] = {
        "type": "http.response.start",
        "status": 413,
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
    }
    await send(start)
    await send({"type": "http.response.body", "body": body})
