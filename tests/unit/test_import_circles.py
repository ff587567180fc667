"""No import circle in worker/ or api/: every import counts, at module level, inside a function or under
``TYPE_CHECKING``, so a circle cannot hide where it only bites later (a lazy import) or only in the types.

Imports are read with ast (nothing is imported); ``python -m pytest tests/unit/test_import_circles.py``
prints each circle's edges with their lines.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("worker", "api")


def modules(root: Path, packages: tuple[str, ...] = PACKAGES) -> dict[str, tuple[Path, bool]]:
    """Every module of ``packages`` under ``root``: its dotted name -> (file, is it a package)."""
    found: dict[str, tuple[Path, bool]] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


def import_edges(root: Path, packages: tuple[str, ...] = PACKAGES) -> dict[str, dict[str, int]]:
    """module -> {module of ours it imports: the line of the first such import}."""
    known = modules(root, packages)

    def ours(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, dict[str, int]] = {}
    for name, (path, is_package) in known.items():
        out = edges.setdefault(name, {})
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:  # relative: from the package this module is in (or is)
                    package = name.split(".") if is_package else name.split(".")[:-1]
                    package = package[: len(package) - node.level + 1]
                    base = ".".join([*package, *([node.module] if node.module else [])])
                # "from package import module" imports the module; "from module import name", the module.
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                    for alias in node.names
                ]
            for target in filter(None, map(ours, targets)):
                if target != name:
                    out.setdefault(target, node.lineno)
    return edges


def circles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    return [sorted(group) for group in _Tarjan(edges).groups() if len(group) > 1]


class _Tarjan:
    def __init__(self, edges: dict[str, dict[str, int]]) -> None:
        self.edges = edges
        self.index: dict[str, int] = {}
        self.low: dict[str, int] = {}
        self.stack: list[str] = []
        self.found: list[list[str]] = []

    def groups(self) -> list[list[str]]:
        sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(self.edges)))
        for node in self.edges:
            if node not in self.index:
                self.visit(node)
        return self.found

    def visit(self, node: str) -> None:
        self.index[node] = self.low[node] = len(self.index)
        self.stack.append(node)
        for child in self.edges.get(node, {}):
            if child not in self.index:
                self.visit(child)
                self.low[node] = min(self.low[node], self.low[child])
            elif child in self.stack:
                self.low[node] = min(self.low[node], self.index[child])
        if self.low[node] == self.index[node]:
            at = len(self.stack) - self.stack[::-1].index(node) - 1
            self.found.append(self.stack[at:])
            del self.stack[at:]


def described(group: list[str], edges: dict[str, dict[str, int]]) -> str:
    inside = set(group)
    lines = [
        f"  {module}:{line} imports {target}"
        for module in group
        for target, line in sorted(edges[module].items())
        if target in inside
    ]
    return "\n".join([" <-> ".join(group), *lines])


def test_worker_and_api_have_no_import_circle() -> None:
    edges = import_edges(ROOT)
    assert "worker.runtime.engine" in edges and "api.app" in edges  # the tree was read
    found = circles(edges)
    assert found == [], "import circles:\n" + "\n".join(described(group, edges) for group in found)


def test_a_circle_through_a_function_or_type_checking_import_is_found(tmp_path: Path) -> None:
    package = tmp_path / "worker"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from worker.sub import b\n")
    (package / "sub" / "b.py").write_text("def f():\n    from ..c import thing\n")
    (package / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import worker.a\n"
    )
    (package / "d.py").write_text("import worker.a\n")  # into the circle, not part of it
    edges = import_edges(tmp_path, ("worker",))
    assert circles(edges) == [["worker.a", "worker.c", "worker.sub.b"]]
