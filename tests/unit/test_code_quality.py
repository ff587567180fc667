"""The code stays lint-clean, typed, and layered: the pure core and the API never load heavy edges."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.fresh import fresh_python

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
        ("worker.batching.sequences", ["celery", "kombu", "redis", "sqlalchemy", "torch"]),
        ("worker.tuning.choice", ["celery", "redis", "sqlalchemy", "torch"]),
        ("worker.tuning.history", ["celery", "redis", "sqlalchemy", "torch"]),
        ("api", ["torch", "transformers"]),
        ("api.app", ["torch", "transformers"]),  # the whole app: routes, registry checks, client, store
        ("worker.tasks", ["torch", "transformers"]),
        ("worker.client", ["torch", "transformers"]),
    ],
)
def test_imports_stay_light(module: str, forbidden: list[str]) -> None:
    code = f"import sys, {module}; print(' '.join(m for m in {forbidden!r} if m in sys.modules))"
    printed = fresh_python(code)
    assert printed.strip() == ""


def test_a_producer_import_loads_no_engine_store_or_model() -> None:
    """`from worker.tasks import infer` loads Celery and the checks: never the engine, SQL or a model."""
    code = "import sys\nfrom worker.tasks import infer\nprint(' '.join(sorted(sys.modules)))\n"
    printed = fresh_python(code)
    loaded = printed.split()
    heavy = [m for m in loaded if m.startswith(("worker.runtime", "worker.store", "sqlalchemy", "torch"))]
    models = [
        m
        for m in loaded
        if m.startswith("worker.models.") and m not in ("worker.models.base", "worker.models.registry")
    ]
    assert heavy == [] and models == [], heavy + models


def test_the_pure_core_imports_nothing_of_the_edges() -> None:
    """worker/batching/ decides what runs next from items, lengths and a clock: no model, runtime, store,
    broker or settings of the project's own."""
    code = (
        "import sys, pkgutil, importlib, worker.batching\n"
        "for module in pkgutil.iter_modules(worker.batching.__path__):\n"
        "    importlib.import_module('worker.batching.' + module.name)\n"
        "edges = [m for m in sys.modules if m.startswith('worker.') and 'batching' not in m]\n"
        "print(' '.join(edges))\n"
    )
    printed = fresh_python(code)
    assert printed.strip() == ""
