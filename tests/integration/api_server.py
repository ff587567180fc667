"""`batchwork api` in a subprocess for integration tests, keys made in its database, and a bounded wait."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import httpx

from tests.integration.processes import CommandProcess
from worker.store.db import make_engine
from worker.store.keys import KeyStore

T = TypeVar("T")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


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


def wait_until(
    check: Callable[[], T | None], timeout_s: float, message: Callable[[], str], poll_s: float = 0.1
) -> T:
    """``check()``'s first truthy answer; AssertionError with ``message()`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not (answer := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"after {timeout_s} s: {message()}")
        time.sleep(poll_s)
    return answer
