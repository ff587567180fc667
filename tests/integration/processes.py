"""Real worker and producer processes for integration tests, each with its own settings in env."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from tests.support.processes import ROOT, Process, batchwork_command
from worker.store.values import FINISHED_STATES

T = TypeVar("T")

READY_LINE = "batchwork engine ready"
# The models the test deployments serve: the built-ins and the tests' own (BATCHWORK_MODELS).
TEST_MODELS = [
    "gpt2",
    "minilm",
    "noop",
    "simulated",
    "tests.support.models:Echo",
    "tests.support.models:LengthEcho",
    "tests.support.models:Counter",
    "tests.support.models:Poison",
    "tests.support.models:OutOfMemoryAbove16",
    "tests.support.models:Crash",
]


def service_env(broker_url: str, database_url: str, **settings: Any) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHWORK_")}
    env.update(BATCHWORK_BROKER_URL=broker_url, BATCHWORK_DATABASE_URL=database_url, HF_HUB_OFFLINE="1")
    env["BATCHWORK_MODELS"] = json.dumps(TEST_MODELS)
    env["PYTHONPATH"] = str(ROOT)
    for name, value in settings.items():
        env[f"BATCHWORK_{name.upper()}"] = value if isinstance(value, str) else json.dumps(value)
    return env


class CommandProcess(Process):
    """A `batchwork` command in a subprocess (tests/support/processes.py), started once a line holds the
    class's ``ready_line``."""

    ready_line = ""

    def __init__(self, env: dict[str, str], *command: str) -> None:
        super().__init__(batchwork_command(*command), env, self.ready_line, name=command[0])


class WorkerProcess(CommandProcess):
    """`batchwork worker` in a subprocess."""

    ready_line = READY_LINE

    def __init__(self, env: dict[str, str], name: str) -> None:
        super().__init__(env, "worker", "--loglevel=INFO", "--hostname", name)


def batchwork(
    cwd: Path, *args: str, env: dict[str, str] | None = None, timeout_s: float = 240
) -> subprocess.CompletedProcess[str]:
    """The ``batchwork`` command run in ``cwd``; with no ``env``, on the embedded default (no settings)."""
    if env is None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHWORK_")}
        env.update(PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    return subprocess.run(
        [sys.executable, "-m", "worker.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


@contextmanager
def workers(env: dict[str, str], count: int = 1) -> Iterator[list[WorkerProcess]]:
    procs = [WorkerProcess(env, f"w{i}@test") for i in range(count)]
    try:
        for proc in procs:
            proc.wait_ready()
        yield procs
    finally:
        for proc in procs:
            proc.stop()


def produce(env: dict[str, str], jobs: Sequence[dict[str, Any]], timeout_s: float = 120) -> list[str]:
    """Submit ``jobs`` from a separate process (see producer.py); returns their job ids in order."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "integration" / "producer.py")],
        input=json.dumps(list(jobs)),
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=timeout_s,
    )
    if done.returncode != 0:
        raise AssertionError(f"producer failed:\n{done.stderr}")
    return json.loads(done.stdout)


def wait_finished(store: Any, job_ids: Sequence[str], timeout_s: float = 120) -> list[Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        statuses = [store.status(job_id) for job_id in job_ids]
        if all(s is not None and s.state in FINISHED_STATES for s in statuses):
            return statuses
        if time.monotonic() > deadline:
            pending = [s for s in statuses if s is None or s.finished_at is None]
            raise AssertionError(f"{len(pending)} jobs unfinished after {timeout_s} s, e.g. {pending[:3]}")
        time.sleep(0.2)


def wait_until(
    check: Callable[[], T | None], timeout_s: float, message: Callable[[], str], poll_s: float = 0.1
) -> T:
    """``check()``'s first truthy answer; AssertionError with ``message()`` after ``timeout_s`` (a test's own
    deadline and reason, never pytest's timeout)."""
    deadline = time.monotonic() + timeout_s
    while not (answer := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"after {timeout_s} s: {message()}")
        time.sleep(poll_s)
    return answer
