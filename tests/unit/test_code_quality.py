"""The code stays lint-clean, typed, and layered: the pure core and the API never load heavy edges."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CODE = ["worker", "api", "tests", "bench", "migrations"]


def run(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *command], cwd=ROOT, capture_output=True, text=True)


def test_ruff_lint() -> None:
    done = run("ruff", "check", *CODE)
    assert done.returncode == 0, done.stdout + done.stderr


def test_ruff_format() -> None:
    done = run("ruff", "format", "--check", *CODE)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.slow
def test_mypy() -> None:
    done = run("mypy")
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize(
    ("module", "forbidden"),
    [
        ("worker.batching.scheduler", ["celery", "kombu", "redis", "sqlalchemy", "torch"]),
        ("worker.tuning.choice", ["celery", "redis", "sqlalchemy", "torch"]),
        ("worker.tuning.history", ["celery", "redis", "sqlalchemy", "torch"]),
        ("api", ["torch", "transformers"]),
        ("worker.tasks", ["torch", "transformers"]),
        ("worker.client", ["torch", "transformers"]),
    ],
)
def test_imports_stay_light(module: str, forbidden: list[str]) -> None:
    code = f"import sys, {module}; print(' '.join(m for m in {forbidden!r} if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ""
