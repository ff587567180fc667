"""The code stays lint-clean, typed, and layered: the pure core and the API never load heavy edges."""

from __future__ import annotations

import ast
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
    # The protocol, the registry and the catalogue of names (models/specs.py) load no model.
    light = ("worker.models.base", "worker.models.registry", "worker.models.specs")
    models = [m for m in loaded if m.startswith("worker.models.") and m not in light]
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


# Celery's and kombu's private parts that worker/celery_compat.py adapts (a section per seam): attributes and
# method names (read or overridden), and the modules beyond the public top level. ``_flush`` is left out (the
# store's file spool has its own); the QoS seam is caught by ``_delivered`` beside it.
PRIVATE_CELERY_NAMES = {
    "_state",
    "_brpop_start",
    "_register_BRPOP",
    "_create_client",
    "_channels",
    "_delivered",
    "_deliver",
    "_get_task_meta_for",
    "fire_timers",
    "type_to_name",
    "buffer_limit",
    "_publish",
    "task_consumer",
    "create_task_handler",
}
PUBLIC_CELERY_MODULES = {"celery", "celery.exceptions", "kombu"}


def private_celery_uses(path: Path) -> list[str]:
    """Where the module at ``path`` reaches past Celery's and kombu's public API, as ``line: what``."""
    tree = ast.parse(path.read_text(), str(path))
    uses = [
        (getattr(node, "lineno", 0), use)
        for node in ast.walk(tree)
        for use in _private_imports(node) + _private_names(node)
    ]
    return [f"{path.relative_to(ROOT)}:{line}: {use}" for line, use in sorted(uses)]


def _private_imports(node: ast.AST) -> list[str]:
    def framework(module: str) -> bool:
        return module.split(".")[0] in ("celery", "kombu")

    if isinstance(node, ast.Import):
        modules = [alias.name for alias in node.names if framework(alias.name)]
        return [f"import {name}" for name in modules if name not in PUBLIC_CELERY_MODULES]
    if isinstance(node, ast.ImportFrom) and framework(node.module or ""):
        uses = [] if node.module in PUBLIC_CELERY_MODULES else [f"from {node.module}"]
        return uses + [alias.name for alias in node.names if alias.name.startswith("_")]
    return []


def _private_names(node: ast.AST) -> list[str]:
    match node:
        case ast.Attribute(attr=name) if name in PRIVATE_CELERY_NAMES:
            return [f".{name}"]
        case ast.FunctionDef(name=name) if name in PRIVATE_CELERY_NAMES:
            return [f"def {name}"]
        case ast.Constant(value=str(text)) if text.startswith(("celery.", "kombu.")):
            return [repr(text)]  # an internal module named by path (a bootstep's requires)
        case ast.Call(func=ast.Attribute(value=ast.Name(id="Task"), attr="apply_async")):
            return ["Task.apply_async(...) past a task's own"]
    return []


def test_celery_and_kombu_internals_are_reached_only_through_celery_compat() -> None:
    """A Celery or kombu upgrade finds every private part batchwork relies on in worker/celery_compat.py,
    each with its contract test (tests/unit/test_celery_compat.py)."""
    compat = ROOT / "worker" / "celery_compat.py"
    paths = [p for package in ("worker", "api") for p in sorted((ROOT / package).rglob("*.py"))]
    found = [use for path in paths if path != compat for use in private_celery_uses(path)]
    where = "worker/celery_compat.py (a section per seam)"
    assert found == [], f"move these behind {where}:\n" + "\n".join(found)


def test_only_the_store_knows_the_tables() -> None:
    """A store backend is added in worker/store/ alone: no module elsewhere in worker/ or api/ imports the
    table definitions (migrations/ does, to compare them with the database)."""
    store = ROOT / "worker" / "store"
    paths = [p for package in ("worker", "api") for p in sorted((ROOT / package).rglob("*.py"))]
    found = []
    for path in paths:
        if store in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import | ast.ImportFrom) else []
            module = node.module if isinstance(node, ast.ImportFrom) else None
            if (
                "worker.store.tables" in names
                or module == "worker.store.tables"
                or (module == "worker.store" and "tables" in names)
            ):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert found == [], "read and write the tables through worker/store/ instead:\n" + "\n".join(found)
