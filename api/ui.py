"""The read-only jobs page: a tenant's jobs with progress bars, and a job's counts, error kinds and batches as
small charts. Server-rendered HTML (Jinja2) with one small inline script that refreshes progress.

It takes the key as a Bearer header or as a cookie set by its login form; the cookie is scoped to /ui and
accepted nowhere else, so it can never submit or cancel a job.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any
from urllib.parse import parse_qs

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from jinja2 import Environment, PackageLoader, select_autoescape

from api.auth import COOKIE, backend, find_key, page_caller
from api.backend import Backend
from worker.store.api_keys import ApiKey
from worker.store.catalog import JobPage
from worker.store.results import BatchRecord
from worker.store.values import FINISHED_STATES, JobState

router = APIRouter(prefix="/ui", include_in_schema=False)
templates = Environment(loader=PackageLoader("api", "templates"), autoescape=select_autoescape())
templates.filters["when"] = lambda moment: "" if moment is None else f"{moment:%Y-%m-%d %H:%M:%S} UTC"
# The states the pages filter by and stop refreshing at, as JobState has them.
templates.globals["job_states"] = [state.value for state in JobState]
templates.globals["finished_states"] = [state.value for state in FINISHED_STATES]

Served = Annotated[Backend, Depends(backend)]
Viewer = Annotated[ApiKey | None, Depends(page_caller)]

COOKIE_MAX_AGE_S = 8 * 3600
BATCHES_SHOWN = 120  # the job page charts the newest batches that carried the job


@dataclass(frozen=True, slots=True)
class Chart:
    """One small bar chart: a bar per batch, oldest on the left, scaled to the largest value."""

    title: str
    unit: str
    bars: list[tuple[float, float, float, float]]  # x, y, width, height in the SVG's 300 x 60 box
    peak: float


def chart(title: str, unit: str, values: list[float]) -> Chart:
    peak = max(values, default=0.0)
    width = 300 / max(len(values), 1)
    bars = []
    for position, value in enumerate(values):
        height = 0.0 if peak <= 0 else 58 * value / peak
        bars.append((position * width, 60 - height, max(width - 1, 0.5), height))
    return Chart(title, unit, bars, peak)


def batch_charts(batches: list[BatchRecord]) -> list[Chart]:
    ordered = list(reversed(batches))  # the store gives the newest first
    return [
        chart("batch size", "items", [b.size for b in ordered]),
        chart("padding", "% of tokens", [_padding(b) for b in ordered]),
        chart("oldest item's wait", "ms", [b.wait_ms for b in ordered]),
        chart("run time", "ms", [b.run_ms for b in ordered]),
    ]


def _padding(batch: BatchRecord) -> float:
    return 0.0 if batch.padded_tokens <= 0 else 100 * (1 - batch.real_tokens / batch.padded_tokens)


def render(name: str, status_code: int = 200, **values: Any) -> HTMLResponse:
    return HTMLResponse(templates.get_template(name).render(**values), status_code=status_code)


@router.get("/", response_class=HTMLResponse)
def jobs_page(
    viewer: Viewer, served: Served, state: Annotated[str | None, Query()] = None, cursor: str | None = None
) -> HTMLResponse:
    if viewer is None:
        return render("login.html", 401)
    if state and state not in set(JobState):  # a state no job is in lists none
        page = JobPage([], None)
    else:
        page = served.jobs.page(viewer.tenants, state=JobState(state) if state else None, cursor=cursor)
    return render("jobs.html", key=viewer, jobs=page.jobs, next_cursor=page.next_cursor, state=state)


@router.get("/jobs/{job_id}", response_class=HTMLResponse)
def job_page(job_id: str, viewer: Viewer, served: Served) -> HTMLResponse:
    if viewer is None:
        return render("login.html", 401)
    job = served.jobs.find(job_id, viewer.tenants)
    if job is None:
        return render("missing.html", 404, key=viewer, job_id=job_id)
    errors = served.catalog.error_kinds(job_id) if job.failed else {}
    batches = served.store.recent_batches(job_id, limit=BATCHES_SHOWN)
    return render("job.html", key=viewer, job=job, errors=errors, charts=batch_charts(batches))


@router.get("/progress")
def progress(viewer: Viewer, served: Served, ids: Annotated[str, Query(max_length=4000)] = "") -> Response:
    """The refresh script's poll: state and counts of the listed jobs the viewer may see."""
    if viewer is None:
        return JSONResponse({"detail": "log in again"}, status_code=401)
    jobs = {}
    for job_id in ids.split(",")[:100]:
        job = served.jobs.find(job_id, viewer.tenants) if job_id else None
        if job is not None:
            jobs[job_id] = {"state": job.state, "total": job.total, "done": job.done, "failed": job.failed}
    return JSONResponse({"jobs": jobs})


@router.post("/login")
async def login(request: Request) -> Response:
    form = parse_qs((await request.body()).decode("utf-8", "replace"))
    key = form.get("key", [""])[0].strip()
    if await find_key(request, key) is None:
        return render("login.html", 401, error="unknown or revoked key")
    response = RedirectResponse("/ui/", status_code=303)
    response.set_cookie(
        COOKIE,
        key,
        max_age=COOKIE_MAX_AGE_S,
        path="/ui",
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )
    return response


@router.post("/logout")
def logout() -> Response:
    response = RedirectResponse("/ui/", status_code=303)
    response.delete_cookie(COOKIE, path="/ui")
    return response
