"""The FastAPI app: the /v1 routes, the jobs page, /healthz, /metrics and /openapi.json, with the body limit,
request metrics and one-line errors around them.

``create_app`` reads the settings once and builds everything the routes use; it never loads a model.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sqlalchemy.exc import DBAPIError
from starlette.concurrency import run_in_threadpool

from api import jobs, openai_routes, ui
from api.auth import backend
from api.backend import Backend
from api.checking import Checker
from api.limits import BodyLimit
from api.metrics import ApiMetrics, RequestMetrics
from api.schemas import Health
from worker.errors import BrokerUnavailable, DatabaseUnavailable, InvalidInput, SetupError
from worker.settings import Settings, get_settings
from worker.store.db import database_unavailable

DESCRIPTION = """Submit batch-inference jobs, poll them and stream their results.

Every /v1 route takes `Authorization: Bearer KEY` (`batchwork keys create --tenant NAME`). A job belongs to
the key's tenant: another tenant's job answers 404. Errors are `{"detail": "one line"}`."""


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    served = Backend.from_settings(settings)
    metrics = ApiMetrics(served)
    checker = Checker(settings)
    openai = openai_routes.OpenAISurface(served)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await run_in_threadpool(checker.start)
        await run_in_threadpool(served.warm)
        openai.start()
        yield
        openai.close()
        checker.close()

    app = FastAPI(title="batchwork", version="1", description=DESCRIPTION, redoc_url=None, lifespan=lifespan)
    app.state.backend = served
    app.state.checker = checker
    app.state.openai = openai
    app.include_router(jobs.router)
    app.include_router(openai_routes.router)
    app.include_router(ui.router)
    app.add_exception_handler(InvalidInput, _invalid_input)  # type: ignore[arg-type]
    app.add_exception_handler(SetupError, _unavailable)  # type: ignore[arg-type]
    app.add_exception_handler(BrokerUnavailable, _unavailable)  # type: ignore[arg-type]
    app.add_exception_handler(DatabaseUnavailable, _unavailable)  # type: ignore[arg-type]
    app.add_exception_handler(DBAPIError, _database_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _invalid_request)  # type: ignore[arg-type]
    # Added last runs first: metrics see every answer, 413s included.
    app.add_middleware(BodyLimit, settings=settings)
    app.add_middleware(RequestMetrics, metrics=metrics)

    @app.get("/healthz", response_model=Health, responses={503: {"model": Health}}, tags=["operations"])
    def healthz(served: Annotated[Backend, Depends(backend)]) -> JSONResponse:
        """No key needed: "ok" when the broker and the database answer, else 503 saying which does not."""
        checks = served.health()
        ok = all(value == "ok" for value in checks.values())
        body = Health(status="ok" if ok else "unavailable", **checks)
        return JSONResponse(body.model_dump(), status_code=200 if ok else 503)

    @app.get("/metrics", include_in_schema=False)
    def prometheus() -> Response:
        return Response(metrics.exposition(), media_type="text/plain; version=0.0.4")

    return app


def _invalid_input(_request: Request, exc: InvalidInput) -> JSONResponse:
    return JSONResponse({"detail": str(exc)}, status_code=422)


def _unavailable(request: Request, exc: Exception) -> JSONResponse:
    """The broker or the database is away (or not set up): 503, and when to try again."""
    retry_after = str(request.app.state.backend.settings.api_retry_after_s)
    return JSONResponse({"detail": str(exc)}, status_code=503, headers={"Retry-After": retry_after})


def _database_error(request: Request, exc: DBAPIError) -> JSONResponse:
    """A route that met the database away (or not migrated) answers 503 like the broker's outage; any
    other database error is a bug and stays a 500 with its traceback."""
    unavailable = database_unavailable(request.app.state.backend.settings.database_url, exc)
    if unavailable is None:
        raise exc
    return _unavailable(request, unavailable)


def _invalid_request(_request: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0]
    where = ".".join(str(part) for part in first["loc"])
    return JSONResponse({"detail": f"{where}: {first['msg']}"}, status_code=422)
