"""`batchwork api` in a subprocess for integration tests, keys made in its database, and a bounded wait."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import httpx
import orjson

from tests.integration.processes import CommandProcess, wait_until
from tests.support.services import free_port
from worker.store.api_keys import KeyStore
from worker.store.db import make_engine
from worker.store.values import FINISHED_STATES

T = TypeVar("T")


class ApiProcess(CommandProcess):
    """`batchwork api` on 127.0.0.1 at a free port."""

    def __init__(self, env: dict[str, str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        super().__init__(env, "api", "--port", str(self.port))

    def wait_healthy(self, timeout_s: float = 60) -> None:
        def healthy() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError("the API exited:\n" + "\n".join(self.log[-40:]))
            try:
                return httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(
            healthy, timeout_s, lambda: "the API did not become healthy:\n" + "\n".join(self.log[-40:])
        )


@contextmanager
def api_server(env: dict[str, str]) -> Iterator[ApiProcess]:
    server = ApiProcess(env)
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


def make_key(database_url: str, tenant: str, admin: bool = False) -> str:
    engine = make_engine(database_url)
    try:
        return KeyStore(engine).create(tenant, admin=admin)[1]
    finally:
        engine.dispose()


class Tenant:
    """An HTTP client holding one API key."""

    def __init__(self, url: str, key: str) -> None:
        self.http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=30)

    def submit(self, model: str, inputs: list[Any], **fields: Any) -> dict[str, Any]:
        answer = self.http.post("/v1/jobs", json={"model": model, "inputs": inputs, **fields})
        assert answer.status_code == 202, answer.text
        return answer.json()  # type: ignore[no-any-return]

    def wait(self, job_id: str, timeout_s: float = 60) -> dict[str, Any]:
        def finished() -> dict[str, Any] | None:
            job = self.http.get(f"/v1/jobs/{job_id}").json()
            return job if job["state"] in FINISHED_STATES else None

        return wait_until(finished, timeout_s, lambda: f"job {job_id} unfinished", poll_s=0.2)

    def results(self, job_id: str, **params: Any) -> list[dict[str, Any]]:
        answer = self.http.get(f"/v1/jobs/{job_id}/results", params=params)
        assert answer.status_code == 200, answer.text
        assert answer.headers["content-type"].startswith("application/x-ndjson")
        return [orjson.loads(line) for line in answer.content.splitlines()]


def texts(prefix: str, n: int) -> list[dict[str, str]]:
    return [{"id": f"{prefix}-{i}", "text": f"{prefix} item {i}"} for i in range(n)]


def ndjson_chunks(items: list[Any], per_chunk: int = 100) -> Iterator[bytes]:
    """The body in pieces, so httpx sends it chunked (no Content-Length) as a streaming producer would."""
    for start in range(0, len(items), per_chunk):
        yield b"".join(orjson.dumps(item) + b"\n" for item in items[start : start + per_chunk])


def scrape(url: str) -> dict[str, float]:
    """Prometheus text format as {'name{labels}': value}, labels in the exposition's own order."""
    samples = {}
    for line in httpx.get(url, timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples
