"""Optional py-spy sampling of a worker during one measured phase, summed up as where the time goes.

Used by bench.pipeline's figures with ``--py-spy DIR``; needs py-spy (``pip install -e '.[dev]'``) and ptrace
rights.
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

IDLE_LEAVES = (
    "wait (threading.py",
    "_wait_for_tstate_lock",
    "select (",
    "poll (",
    "epoll",
    "get (queue.py",
    "sleep (",
    "_read_from_socket",
    "recv_into",
    "readline (socket.py",
    "acquire (",
)


@contextmanager
def record(
    pid: int, out_dir: Path | None, name: str, gil: bool = False, rate_hz: int = 200
) -> Iterator[None]:
    """Sample ``pid`` (and its children) while the block runs; prints a summary afterwards.

    With ``gil`` only samples of the thread holding the GIL count: where a GIL-bound worker spends it.
    """
    binary = shutil.which("py-spy")
    if out_dir is None or binary is None:
        yield
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.txt"
    argv = [
        binary,
        "record",
        "--pid",
        str(pid),
        "--rate",
        str(rate_hz),
        "--format",
        "raw",
        "--threads",
        "--subprocesses",
        "--nonblocking",
        "--output",
        str(path),
        *(["--gil"] if gil else []),
    ]
    spy = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        yield
    finally:
        spy.send_signal(signal.SIGINT)
        try:
            _, err = spy.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            spy.kill()
            err = spy.communicate()[1]
        if path.exists():
            print_summary(path, name)
        else:
            print(f"  py-spy {name}: no profile ({err.strip()[-300:]})")


def print_summary(path: Path, name: str, top: int = 14) -> None:
    """Busy samples per thread, and per busy thread its hottest leaves and the project/queue/SQL frames."""
    per_thread, leaf, inclusive = _tally(path)
    busy = sum(per_thread.values())
    print(f"  py-spy {name}: {busy} busy samples ({path}); shares are of all busy samples")
    for thread, count in per_thread.most_common(5):
        if count < 0.03 * busy:
            break
        print(f"    {count / busy:6.1%}  {thread}")
        mine = [("self", f, n) for (t, f), n in leaf.most_common() if t == thread]
        mine += [("incl", f, n) for (t, f), n in inclusive.most_common() if t == thread][:top]
        for kind, frame, n in mine:
            if n >= 0.01 * busy:
                print(f"      {kind} {n / busy:6.1%}  {frame}")


Tally = Counter[tuple[str, str]]


def _tally(path: Path) -> tuple[Counter[str], Tally, Tally]:
    per_thread: Counter[str] = Counter()
    leaf: Tally = Counter()
    inclusive: Tally = Counter()
    for line in path.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        frames = [_without_line(frame) for frame in stack.split(";")]
        if not stack or not count_text.isdigit() or any(idle in frames[-1] for idle in IDLE_LEAVES):
            continue
        count = int(count_text)
        thread = frames[1] if frames[0].startswith("process ") and len(frames) > 1 else frames[0]
        per_thread[thread] += count
        leaf[thread, frames[-1]] += count
        for frame in set(frames):
            if INTERESTING.search(frame) and "worker/cli.py" not in frame:
                inclusive[thread, frame] += count
    return per_thread, leaf, inclusive


# Frames worth naming in a summary: the project's own, the queue and event plumbing, SQL statement execution.
INTERESTING = re.compile(
    r"\((worker|bench|celery_batches)/|QoS\.(ack|append)|_brpop_read|EventDispatcher\.publish|"
    r"Connection\.execute \(sqlalchemy|Connection\.commit|Task\.apply_async|Producer\.publish|basic_publish"
)


def _without_line(frame: str) -> str:
    return re.sub(r":\d+\)$", ")", frame)
