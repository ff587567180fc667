"""A wheel built from the repository, installed without it (not editable), works from any folder: the
migrations and templates ship inside the package."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.integration.processes import ROOT

EXAMPLE = ROOT / "examples" / "docs.jsonl"


@pytest.mark.slow
def test_an_installed_wheel_migrates_and_runs_from_any_folder(tmp_path: Path) -> None:
    wheels, target, elsewhere = tmp_path / "wheels", tmp_path / "site", tmp_path / "elsewhere"
    elsewhere.mkdir()
    build = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels), str(ROOT)]
    subprocess.run(build, check=True, capture_output=True, timeout=300)
    [wheel] = wheels.glob("batchwork-*.whl")
    install = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)]
    subprocess.run(install, check=True, capture_output=True, timeout=300)
    # Dependencies come from this venv; batchwork itself only from the installed wheel.
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHWORK_")}
    env.update(PYTHONPATH=str(target), HF_HUB_OFFLINE="1")
    where = subprocess.run(
        [sys.executable, "-c", "import worker; print(worker.__file__)"], env=env, cwd=elsewhere,
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert where.stdout.strip().startswith(str(target))
    batchwork = str(target / "bin" / "batchwork")

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [batchwork, *args], env=env, cwd=elsewhere, capture_output=True, text=True, timeout=240
        )

    migrated = run("migrate")
    assert migrated.returncode == 0, migrated.stderr
    done = run("run", str(EXAMPLE), "-m", "noop", "-o", "out.jsonl")
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in (elsewhere / "out.jsonl").read_text().splitlines()]
    assert len(lines) == 20 and all(line["output"] == 0 for line in lines)


def test_every_package_is_listed_for_the_wheel() -> None:
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        ".".join(path.parent.relative_to(ROOT).parts)
        for top in ("worker", "api")
        for path in (ROOT / top).rglob("__init__.py")
    }
    assert found <= listed, f"add {sorted(found - listed)} to [tool.setuptools] packages in pyproject.toml"
