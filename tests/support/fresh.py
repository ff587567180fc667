"""Code run by a new interpreter in the repository root: what a first import loads, seen from outside."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def fresh_python(code: str) -> str:
    """The standard output of ``python -c code`` in a new process, which must exit 0."""
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout
