"""A redis-server and a PostgreSQL server of the caller's own: installed binaries, a free port on 127.0.0.1,
a temporary directory, no persistence. Nothing here talks to a server it did not start.

Both servers die with the process that started them (``PR_SET_PDEATHSIG``), so a killed test run does not
leave them behind. ``initdb`` refuses to run as root: as root the PostgreSQL server runs as the ``postgres``
OS user, in a directory that user owns.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import redis

START_TIMEOUT_S = 120.0
PG_SUPERUSER = "batchwork"
PG_DATABASE = "test"


class ServiceUnavailable(RuntimeError):
    """A server could not be started here (a binary missing, no user to run it as); one line, the cause."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _die_with_parent(sig: int) -> Callable[[], None]:
    def preexec() -> None:
        # PR_SET_PDEATHSIG = 1; set after any uid change (Popen's user= runs before preexec_fn), so it holds.
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, sig, 0, 0, 0)

    return preexec


def _binary(name: str, *fallback_globs: str) -> str:
    found = shutil.which(name)
    if found is None:
        # Debian's postgresql package keeps its server binaries off PATH, one folder per major version.
        candidates = sorted(
            (path for pattern in fallback_globs for path in glob.glob(pattern)),
            key=lambda p: [int(part) if part.isdigit() else 0 for part in Path(p).parts],
        )
        found = candidates[-1] if candidates else None
    if found is None:
        raise ServiceUnavailable(f"`{name}` is not installed (the integration tests start their own server)")
    return found


class _Server:
    name = "server"
    stop_signal = signal.SIGTERM

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix=f"batchwork-test-{self.name}-"))
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def log_path(self) -> Path:
        return self.dir / f"{self.name}.log"

    def _log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-2000:]
        except OSError:
            return "(no log)"

    def _wait_ready(self, ready: Callable[[], bool]) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}: {self._log_tail()}")
            with contextlib.suppress(Exception):
                if ready():
                    return
            time.sleep(0.05)
        raise RuntimeError(f"{self.name} not ready after {START_TIMEOUT_S:.0f} s: {self._log_tail()}")

    def _popen(self, argv: list[str], **kwargs: Any) -> None:
        log = open(self.log_path, "ab")  # noqa: SIM115  (the server's own, closed with it)
        try:
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent(self.stop_signal),
                **kwargs,
            )
        finally:
            log.close()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(self.stop_signal)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> _Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class RedisServer(_Server):
    """``redis-server`` on a free port; ``url`` has no database number (append ``/N``)."""

    name = "redis"

    def __init__(self, databases: int = 16) -> None:
        binary = _binary("redis-server")
        super().__init__()
        try:
            self._start(binary, databases)
        except BaseException:
            self.stop()
            raise

    def _start(self, binary: str, databases: int) -> None:
        for _ in range(5):  # the free port may be taken between the probe and the bind
            self.port = free_port()
            # Options as arguments, no config file: the server has no ties to the machine's own Redis.
            argv = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir)]
            argv += ["--save", "", "--appendonly", "no", "--databases", str(databases), "--daemonize", "no"]
            argv += ["--logfile", str(self.log_path), "--protected-mode", "no"]
            self._popen(argv)
            try:
                self._wait_ready(self._ping)
                return
            except RuntimeError:
                if "Address already in use" not in self._log_tail():
                    raise
        raise RuntimeError(f"redis-server found no free port: {self._log_tail()}")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def _ping(self) -> bool:
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1)
        try:
            return bool(client.ping())
        finally:
            client.close()


class PostgresServer(_Server):
    """A fresh cluster (``initdb``) served by ``postgres`` on a free port, with a database ``test`` and a
    superuser ``batchwork`` that needs no password; fsync off, as nothing here must survive a crash."""

    name = "postgres"
    stop_signal = signal.SIGINT  # "fast" shutdown: ends open sessions instead of waiting for them

    def __init__(self, max_connections: int = 300) -> None:
        initdb = _binary("initdb", "/usr/lib/postgresql/*/bin/initdb")
        postgres = _binary("postgres", "/usr/lib/postgresql/*/bin/postgres")
        account = self._account()
        super().__init__()
        try:
            self._start(initdb, postgres, account, max_connections)
        except BaseException:
            self.stop()
            raise

    @staticmethod
    def _account() -> dict[str, Any]:
        if os.geteuid() != 0:
            return {}
        try:
            user = pwd.getpwnam("postgres")
        except KeyError:
            raise ServiceUnavailable(
                "PostgreSQL refuses to run as root and there is no `postgres` OS user to run it as"
            ) from None
        return {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}

    def _start(self, initdb: str, postgres: str, account: dict[str, Any], max_connections: int) -> None:
        if account:
            os.chown(self.dir, account["user"], account["group"])
        data = self.dir / "data"
        setup = subprocess.run(
            [initdb, "-D", str(data), "-U", PG_SUPERUSER, "--auth=trust", "--no-sync", "-E", "UTF8"]
            + ["--locale=C.UTF-8"],
            capture_output=True,
            text=True,
            env={**os.environ, "LC_ALL": "C.UTF-8"},
            **account,
        )
        if setup.returncode != 0:
            raise RuntimeError(f"initdb failed: {(setup.stderr or setup.stdout).strip()[-2000:]}")
        for _ in range(5):
            self.port = free_port()
            argv = [postgres, "-D", str(data), "-p", str(self.port), "-c", "listen_addresses=127.0.0.1"]
            for setting in (
                f"unix_socket_directories={self.dir}",
                f"max_connections={max_connections}",
                "fsync=off",
                "synchronous_commit=off",
                "full_page_writes=off",
            ):
                argv += ["-c", setting]
            self._popen(argv, **account)
            try:
                self._wait_ready(self._connectable)
                break
            except RuntimeError:
                if "already in use" not in self._log_tail():
                    raise
        else:
            raise RuntimeError(f"postgres found no free port: {self._log_tail()}")
        with psycopg.connect(self._conninfo("postgres"), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {PG_DATABASE}")

    def _conninfo(self, database: str) -> str:
        return f"host=127.0.0.1 port={self.port} user={PG_SUPERUSER} dbname={database} connect_timeout=2"

    def _connectable(self) -> bool:
        with psycopg.connect(self._conninfo("postgres")):
            return True

    @property
    def url(self) -> str:
        """SQLAlchemy URL of the ``test`` database."""
        return f"postgresql+psycopg://{PG_SUPERUSER}@127.0.0.1:{self.port}/{PG_DATABASE}"
