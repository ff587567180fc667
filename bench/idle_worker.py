"""The CPU an idle ``batchwork worker`` (noop) spends on its own loops: the consumer thread's fetch and outbox
timers, the watch and store threads. That fixed cost is what a worker loses to a plain loop when it gets only
a share of the machine (bench.pipeline figure 1).

Starts its own Redis and PostgreSQL as bench.pipeline does; prints one line, never asserts. From the
repository root: ``python -m bench.idle_worker [--seconds 20]``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from bench import harness as h


def main(argv: Sequence[str] | None = None) -> None:
    parser = h.arguments(__doc__)
    parser.add_argument("--seconds", type=float, default=20, help="how long to measure the idle worker")
    args = parser.parse_args(argv)
    with h.stack() as found:
        worker = h.worker(found, "idle")
        worker.wait_ready()
        time.sleep(3)  # past its start-up
        before, started = h.group_cpu_s(worker.pid), time.monotonic()
        time.sleep(args.seconds)
        used = h.group_cpu_s(worker.pid) - before
        print(f"idle noop worker: {used / (time.monotonic() - started):.3f} cores over {args.seconds:g} s")
        worker.stop()


if __name__ == "__main__":
    main()
