"""A broker or database URL batchwork cannot use ends every command in one line and exit code 2, before it
does anything (issue 17 class 3); so does a `tune -o` folder that cannot be written."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
COMMANDS = [
    ["run", "in.jsonl", "-m", "noop"],
    ["worker"],
    ["submit", "in.jsonl", "-m", "noop"],
    ["status", "00000000-0000-0000-0000-000000000000"],
    ["api", "--port", "0"],
    ["migrate"],
    ["keys", "list"],
    ["tune", "noop"],
]
BAD = [
    ("BROKER_URL", "amqp://guest:secret@localhost:5672//", "amqp://...: batchwork's broker is Redis"),
    ("BROKER_URL", "garbage", "not a URL"),
    ("DATABASE_URL", "mysql://user:secret@localhost/db", "'mysql' is not a database batchwork runs on"),
    ("DATABASE_URL", "::garbage::", "not a database URL"),
]


def batchwork(cwd: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "worker.cli", *args],
        cwd=cwd,
        env={**env, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(("setting", "url", "says"), BAD, ids=[f"{s}={u[:12]}" for s, u, _ in BAD])
def test_every_command_refuses_the_url_in_one_line(tmp_path: Path, setting: str, url: str, says: str) -> None:
    (tmp_path / "in.jsonl").write_text('"a"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHWORK_")}
    env[f"BATCHWORK_{setting}"] = url
    for command in COMMANDS:
        done = batchwork(tmp_path, env, *command)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2, (command, done.stderr[-2000:])
        assert lines == [f"error: bad setting BATCHWORK_{setting}: {lines[0].split(': ', 2)[2]}"], command
        assert says in lines[0] and "secret" not in lines[0], command
        assert done.stdout == "", command
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]  # nothing created


@pytest.mark.parametrize("where", ["/proc/batchwork-tune", "a-file", "a-file/below"])
def test_tune_refuses_an_output_folder_it_cannot_write_before_measuring(tmp_path: Path, where: str) -> None:
    (tmp_path / "a-file").write_text("mine\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHWORK_")}
    env["BATCHWORK_DATABASE_URL"] = f"sqlite:///{tmp_path / 'batchwork.db'}"
    done = batchwork(tmp_path, env, "tune", "simulated", "--point-s", "5", "-o", where)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines() == [
        f"error: -o {where}: cannot write there ({done.stderr.split('(', 1)[1].strip()}"
    ]
    assert done.stdout == ""  # no sweep ran: it would print its table
    assert (tmp_path / "a-file").read_text() == "mine\n"
