"""How many project files (worker/, api/) one ``infer.delay`` noop item crosses, producer to stored row.

A file counts when a Python function of it is called, on any thread of this (the producer's) process or of
the ``batchwork worker`` it starts. The profiler is on every thread from the start, recording only while on:
after a warm-up item is stored, real-time signals switch it on (SIGRTMIN+3) and, once the traced item's row
is stored, off (SIGRTMIN+4, the worker writes its set). Prints the sorted file list and the count.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import FrameType

from bench import harness

ON, OFF = signal.SIGRTMIN + 3, signal.SIGRTMIN + 4
PROJECT = tuple(f"{harness.ROOT / part}/" for part in ("worker", "api"))
_recording = False
_files: set[str] = set()


def _profile(frame: FrameType, event: str, _arg: object) -> None:
    if _recording and event == "call":
        _files.add(frame.f_code.co_filename)


def traced_worker(out: str, hostname: str) -> None:
    """``batchwork worker``, with the profiler on its threads and the signals that switch it."""

    def switch(signum: int, _frame: object) -> None:
        global _recording
        _recording = signum == ON
        if not _recording:
            Path(out).write_text("".join(f"{name}\n" for name in sorted(_files)))
        print(f"item_path: recording {'on' if _recording else 'off'}", flush=True)

    for signum in (ON, OFF):
        signal.signal(signum, switch)
    sys.setprofile(_profile)
    threading.setprofile(_profile)  # before the worker starts its threads, which inherit it
    from worker.cli import main

    sys.argv = ["batchwork", "worker", "--loglevel=INFO", "--hostname", hostname]
    main()


def _switch(worker: harness.Process, signum: int, line: str) -> None:
    worker.proc.send_signal(signum)
    deadline = time.monotonic() + 30
    while not any(line in logged for logged in worker.log):  # Celery logs what its worker prints
        if time.monotonic() > deadline:
            raise RuntimeError(f"the worker never said {line!r}:\n" + "\n".join(worker.log[-30:]))
        time.sleep(harness.POLL_S)


def main() -> None:
    global _recording
    harness.arguments(__doc__).parse_args()
    sys.setprofile(_profile)
    threading.setprofile(_profile)
    with harness.stack() as found:
        out = Path(tempfile.gettempdir()) / f"item-path-{os.getpid()}.txt"
        argv = harness.python("bench.item_path", "--worker", str(out), "traced@bench")
        worker = harness.start(argv, found.env(), "traced", harness.CELERY_READY)
        worker.wait_ready()
        from worker.tasks import infer

        infer.delay(model="noop", inputs=["warm-up"])
        harness.wait_rows(found, "results", 1, timeout_s=60)
        _switch(worker, ON, "item_path: recording on")
        _recording = True
        infer.delay(model="noop", inputs=["the traced item"])
        harness.wait_rows(found, "results", 2, timeout_s=60)  # SQL through SQLAlchemy: no project file
        _recording = False
        _switch(worker, OFF, "item_path: recording off")
        files = _files | set(out.read_text().split())
        out.unlink()
    shown = sorted(str(Path(name).relative_to(harness.ROOT)) for name in files if name.startswith(PROJECT))
    print("\n".join(shown))
    print(f"{len(shown)} project files on one infer.delay item's path (producer and worker, every thread)")


if __name__ == "__main__":
    traced_worker(*sys.argv[2:4]) if sys.argv[1:2] == ["--worker"] else main()
