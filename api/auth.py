"""Who is calling: an API key from ``Authorization: Bearer KEY`` (or, for the jobs page, its cookie).

A missing, unknown or revoked key is 401 everywhere; what a key may see is its ``tenants``. A key found
is remembered for KEY_CACHE_S, so a revoked key is refused within that long.
"""

from __future__ import annotations

import threading
import time
from typing import Annotated

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.concurrency import run_in_threadpool

from api.backend import Backend
from worker.store.keys import ApiKey, key_hash

COOKIE = "batchwork_key"
UNAUTHORIZED = "missing, unknown or revoked API key: send 'Authorization: Bearer KEY' (batchwork keys create)"

# auto_error=False: the answer to a missing key is ours (401 with one line), not FastAPI's.
bearer = HTTPBearer(auto_error=False, description="a key from `batchwork keys create --tenant NAME`")


# Pollers ask many times a second; a database round trip per request for the key would double the cost
# of GET /v1/jobs/{id}. Unknown keys are not remembered: a new key works at once.
KEY_CACHE_S = 2.0
KEY_CACHE_SIZE = 10_000


class KeyCache:
    """Keys found recently, by hash, for KEY_CACHE_S; shared by the request threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._found: dict[str, tuple[float, ApiKey]] = {}

    def get(self, digest: str) -> ApiKey | None:
        entry = self._found.get(digest)
        if entry is None or entry[0] < time.monotonic():
            return None
        return entry[1]

    def put(self, digest: str, key: ApiKey) -> None:
        with self._lock:
            if len(self._found) >= KEY_CACHE_SIZE:
                self._found.clear()
            self._found[digest] = (time.monotonic() + KEY_CACHE_S, key)


def backend(request: Request) -> Backend:
    return request.app.state.backend  # type: ignore[no-any-return]


async def find_key(request: Request, key: str | None) -> ApiKey | None:
    """The live key ``key`` is; a remembered one without leaving the event loop, else from the store."""
    if not key:
        return None
    cache: KeyCache = request.app.state.key_cache
    digest = key_hash(key)
    found = cache.get(digest)
    if found is None:
        found = await run_in_threadpool(backend(request).keys.find, key)
        if found is not None:
            cache.put(digest, found)
    return found


async def caller(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]
) -> ApiKey:
    """The key of an API request (Bearer only: a cookie must not let another site's form submit jobs)."""
    found = await find_key(request, credentials.credentials if credentials else None)
    if found is None:
        raise HTTPException(401, UNAUTHORIZED, headers={"WWW-Authenticate": "Bearer"})
    return found


async def page_caller(request: Request) -> ApiKey | None:
    """The key of a jobs-page request: the Bearer header, else the cookie set at login; None if neither."""
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        key = request.cookies.get(COOKIE, "")
    return await find_key(request, key.strip())
