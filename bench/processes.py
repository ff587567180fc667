"""Worker subprocesses for the benches: start, wait for their ready line, stop, keep their log, meter CPU.

Every process started here is in its own session (process group), so stopping it also stops the children
of a prefork pool; ``stop_all`` ends exactly the groups this module started, on exit or Ctrl-C.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Celery's own "celery@host ready." line is logged right before the consumer enters its event loop, so it
# marks the moment a worker starts taking messages; a batching worker logs "batchwork engine ready" first.
CELERY_READY = re.compile(r"@\S+ ready\.")
# A Celery log line carries its level as ": ERROR/MainProcess]"; tracebacks have no level of their own.
PROBLEM = re.compile(r": (WARNING|ERROR|CRITICAL)/|Traceback|Error:")

_started: list[WorkerProcess] = []


class WorkerProcess:
    """One worker command in a subprocess; its log lines and the wall time of its ready line are kept."""

    def __init__(
        self, argv: Sequence[str], env: dict[str, str], name: str, ready: re.Pattern[str] = CELERY_READY
    ):
        self.name = name
        self.log: list[str] = []
        self.started_at = time.time()
        self.ready_at: float | None = None
        self._ready_line = ready
        self._ready = threading.Event()
        self.proc = subprocess.Popen(
            list(argv),
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        _started.append(self)
        threading.Thread(target=self._read, name=f"log-{name}", daemon=True).start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log.append(line.rstrip())
            if not self._ready.is_set() and self._ready_line.search(line):
                self.ready_at = time.time()
                self._ready.set()

    def wait_ready(self, timeout_s: float = 120) -> float:
        """Wall time of the ready line; RuntimeError with the log's tail if it never comes."""
        deadline = time.monotonic() + timeout_s
        while not self._ready.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = "\n".join(self.log[-30:])
                raise RuntimeError(f"worker {self.name} did not start (exit {self.proc.poll()}):\n{tail}")
        assert self.ready_at is not None
        return self.ready_at

    def problems(self) -> list[str]:
        """Log lines at WARNING or above, and traceback lines."""
        return [line.replace("\r", "\\r") for line in self.log if PROBLEM.search(line) and not _blank(line)]

    def stop(self, timeout_s: float = 30) -> None:
        if self.proc.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.proc.wait()
        # Prefork children may outlive their parent by a moment; the group is ours alone.
        self._signal(signal.SIGKILL)
        if self in _started:
            _started.remove(self)

    def _signal(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signum)


def _blank(line: str) -> bool:
    # Celery logs what a library prints to stderr at WARNING; a bare newline leaves "[...: WARNING/...]".
    return line.rstrip().endswith("]") and line.lstrip().startswith("[")


def stop_all() -> None:
    for worker in list(_started):
        worker.stop(timeout_s=10)


def python_module(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


class CpuMeter:
    """CPU used while a block runs, in cores: by this process, by worker process groups, and by everyone else.

    "Others" is the whole machine's busy time less ours and the workers'; it includes PostgreSQL and Redis,
    and on a shared machine it is the noise that explains an outlier.
    """

    def __init__(self, *workers: WorkerProcess) -> None:
        self.workers = workers
        self.cores: dict[str, float] = {}
        self.seconds: dict[str, float] = {}

    def __enter__(self) -> CpuMeter:
        self._wall = time.monotonic()
        self._own = time.process_time()
        self._machine = machine_busy_s()
        self._groups = [group_cpu_s(w.pid) for w in self.workers]
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.monotonic() - self._wall
        own = time.process_time() - self._own
        groups = sum(
            group_cpu_s(w.pid) - before for w, before in zip(self.workers, self._groups, strict=True)
        )
        machine = machine_busy_s() - self._machine
        self.seconds = {"bench": own, "workers": groups, "others": machine - own - groups}
        self.cores = {key: value / wall for key, value in self.seconds.items()}


def machine_busy_s() -> float:
    """Busy CPU seconds of the whole machine so far (user, nice, system, irq, softirq, steal)."""
    with open("/proc/stat") as stat:
        fields = [int(v) for v in stat.readline().split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def group_cpu_s(pgid: int) -> float:
    """CPU seconds used so far by the live processes of one process group (a worker and its pool)."""
    return _cpu_s(lambda name, fields: int(fields[2]) == pgid)


def named_cpu_s(command: str) -> float:
    """CPU seconds used so far by the live processes whose command name starts with ``command``."""
    return _cpu_s(lambda name, fields: name.startswith(command))


def _cpu_s(counts: Callable[[str, list[str]], bool]) -> float:
    """CPU seconds used so far by the live processes ``counts`` picks, given each one's command name and its
    /proc stat fields after the name (state, ppid, pgrp, ..., utime at 11, stime at 12)."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                name, _, rest = stat.read().partition(" (")[2].rpartition(")")
        except OSError:
            continue
        fields = rest.split()
        if counts(name, fields):
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def service_env(broker_url: str, database_url: str) -> dict[str, str]:
    """This process's environment for a worker or API process on the bench's services: no BATCHWORK_ or
    BENCH_ setting of the caller's leaks in, and nothing is fetched from a model hub."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BATCHWORK_", "BENCH_"))}
    env.update(
        BATCHWORK_BROKER_URL=broker_url,
        BATCHWORK_DATABASE_URL=database_url,
        HF_HUB_OFFLINE="1",
        PYTHONPATH=str(ROOT),
        PYTHONUNBUFFERED="1",
    )
    return env
