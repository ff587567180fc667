"""The test session's own servers: the fixtures talk to the redis-server and PostgreSQL this session started
(never to a server already running on the machine), and those servers end with the process that started
them, however it ends."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import redis
from sqlalchemy import text

from tests.integration.processes import ROOT, wait_until
from tests.support.services import PostgresServer, RedisServer
from worker.store.db import make_engine


def test_the_fixtures_use_servers_this_session_started(
    redis_server: RedisServer, postgres_server: PostgresServer, redis_url: str, pg_url: str
) -> None:
    client = redis.Redis.from_url(redis_url)
    try:
        assert client.info("server")["process_id"] == redis_server.proc.pid  # type: ignore[union-attr]
        assert client.config_get("dir")["dir"] == str(redis_server.dir)
    finally:
        client.close()
    engine = make_engine(pg_url)
    try:
        with engine.connect() as conn:
            data_directory = conn.execute(text("SHOW data_directory")).scalar_one()
            postmaster = int(Path(data_directory, "postmaster.pid").read_text().split()[0])
    finally:
        engine.dispose()
    assert Path(data_directory) == postgres_server.dir / "data"
    assert postmaster == postgres_server.proc.pid  # type: ignore[union-attr]


def test_a_server_dies_with_the_process_that_started_it() -> None:
    starter = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from tests.support.services import RedisServer\n"
            "import time\n"
            "server = RedisServer()\n"
            "print(server.proc.pid, server.dir, flush=True)\n"
            "time.sleep(600)\n",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert starter.stdout is not None
    pid_text, directory = starter.stdout.readline().split(maxsplit=1)
    pid = int(pid_text)
    os.kill(pid, 0)  # running
    starter.send_signal(signal.SIGKILL)  # no cleanup of its own
    starter.wait()

    def gone() -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        # A zombie until its parent (init, here) reaps it: gone all the same.
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z")

    try:
        wait_until(gone, 30, lambda: f"redis-server {pid} outlived the process that started it")
    finally:
        shutil.rmtree(directory.strip(), ignore_errors=True)  # what the killed process had no time to remove
