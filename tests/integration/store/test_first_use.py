"""First use by several processes at once: each `batchwork run` in an empty folder, each `batchwork migrate`
of an empty database, succeeds; whoever comes second finds the schema made (a lock beside a SQLite file, an
advisory lock on PostgreSQL)."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy.exc import OperationalError

from tests.integration.cli.test_cli_mistakes import embedded_env
from tests.integration.processes import service_env
from worker.store.db import database_unavailable
from worker.store.results import ResultStore


def _together(
    cwd: Path, env: dict[str, str], commands: list[list[str]]
) -> list[subprocess.CompletedProcess[str]]:
    """The ``batchwork`` commands started at once; each one's outcome once all have ended."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "worker.cli", *args],
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for args in commands
    ]
    done = []
    for proc, args in zip(procs, commands, strict=True):
        out, err = proc.communicate(timeout=300)
        done.append(subprocess.CompletedProcess(args, proc.returncode, out, err))
    return done


@pytest.mark.slow
@pytest.mark.parametrize("runs", [3, 5])
def test_runs_started_together_in_an_empty_folder_all_succeed(tmp_path: Path, runs: int) -> None:
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": f"t{i}"}) + "\n" for i in range(20)))
    commands = [["run", "in.jsonl", "-m", "noop", "-o", f"out{n}.jsonl"] for n in range(runs)]
    for done in _together(tmp_path, embedded_env(), commands):
        assert done.returncode == 0, done.stderr
    for n in range(runs):
        assert len((tmp_path / f"out{n}.jsonl").read_text().splitlines()) == 20
    store = ResultStore.from_url(f"sqlite:///{tmp_path / 'batchwork.db'}")
    try:
        with store.engine.connect() as conn:
            states = conn.exec_driver_sql("SELECT state, count(*) FROM jobs GROUP BY state").all()
    finally:
        store.close()
    assert [tuple(row) for row in states] == [("succeeded", runs)]


@pytest.mark.parametrize("migrations", [2, 4])
def test_migrations_started_together_on_an_empty_database_all_succeed(
    tmp_path: Path, empty_db_url: str, migrations: int
) -> None:
    env = service_env("redis://127.0.0.1:1/0", empty_db_url)
    for done in _together(tmp_path, env, [["migrate"]] * migrations):
        assert done.returncode == 0, done.stderr
        assert "is at the latest schema" in done.stderr
    store = ResultStore.from_url(empty_db_url)
    try:
        assert store.has_schema()
    finally:
        store.close()


@pytest.mark.parametrize(
    "reason",
    ["table generated_tokens already exists", "database is locked", "unable to open database file"],
)
def test_a_sqlite_failure_is_not_called_unreachable(reason: str) -> None:
    failure = OperationalError("CREATE TABLE ...", {}, sqlite3.OperationalError(reason))
    line = str(database_unavailable("sqlite:///batchwork.db", failure))
    assert line == f"cannot use the database sqlite:///batchwork.db: {reason}"
    server = str(database_unavailable("postgresql+psycopg://u:secret@db/x", failure))
    assert server.startswith("cannot reach the database postgresql+psycopg://u:***@db/x")
