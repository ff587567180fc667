"""Commands in processes of their own, for the integration tests and the benches alike: each in its own
process group (stopping it stops a prefork pool or the API's checking processes too), its log kept, and the
wall time of its ready line noted.
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
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def batchwork_command(*args: str) -> list[str]:
    """The ``batchwork`` command line with this interpreter (no console script needed)."""
    return [sys.executable, "-m", "worker.cli", *args]


class Process:
    """``argv`` started in ROOT with ``env``; ``ready`` is set once a line matches ``ready_line``."""

    def __init__(self, argv: Sequence[str], env: dict[str, str], ready_line: str = "", name: str = ""):
        self.name, self.log, self.ready_at = name or argv[-1], list[str](), 0.0
        self.ready, self._ready_line = threading.Event(), re.compile(ready_line) if ready_line else None
        self.proc = subprocess.Popen(list(argv), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
        self.pid = self.proc.pid
        self._reader = threading.Thread(target=self._read, name=f"log-{self.name}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log.append(line.rstrip())
            if self._ready_line is not None and not self.ready.is_set() and self._ready_line.search(line):
                self.ready_at = time.time()
                self.ready.set()

    def wait_ready(self, timeout_s: float = 90) -> float:
        """Wall time of the ready line; RuntimeError with the log's tail if the process ends or it never
        comes."""
        deadline = time.monotonic() + timeout_s
        while not self.ready.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = "\n".join(self.log[-40:])
                raise RuntimeError(f"{self.name} did not start (exit {self.proc.poll()}):\n{tail}")
        return self.ready_at

    def stop(self, timeout_s: float = 30) -> None:
        """SIGTERM to the group, SIGKILL after ``timeout_s``; the log pipe closed once read."""
        if self.proc.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.proc.wait()
        self._signal(signal.SIGKILL)  # prefork children may outlive their parent by a moment
        self._reader.join(5)
        if not self._reader.is_alive() and self.proc.stdout is not None:
            self.proc.stdout.close()

    def _signal(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signum)
