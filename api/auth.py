"""Who is calling: an API key from ``Authorization: Bearer KEY`` (or, for the jobs page, its cookie).

A missing, unknown or revoked key is 401 everywhere; what a key may see is its ``tenants``. Every request
looks its key up in the store (one indexed read), so a key revoked is refused by the very next request in
every API process; no process remembers a key.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.concurrency import run_in_threadpool

from api.backend import Backend
from worker.store.api_keys import ApiKey

COOKIE = "batchwork_key"
UNAUTHORIZED = "missing, unknown or revoked API key: send 'Authorization: Bearer KEY' (batchwork keys create)"

# auto_error=False: the answer to a missing key is ours (401 with one line), not FastAPI's.
bearer = HTTPBearer(auto_error=False, description="a key from `batchwork keys create --tenant NAME`")


def backend(request: Request) -> Backend:
    return request.app.state.backend  # type: ignore[no-any-return]


async def find_key(request: Request, key: str | None) -> ApiKey | None:
    """The live key ``key`` is, read from the store on every request.

    Not cached: a cache would let a revoked key through until it expired (it was 2 s). The read is one
    indexed query on an autocommit connection; `python -m bench.api --auth 1,16` prints its cost beside a
    status poll's.
    """
    if not key:
        return None
    return await run_in_threadpool(backend(request).keys.find, key)


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
