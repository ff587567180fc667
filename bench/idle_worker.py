"""The CPU (in cores) an idle noop ``batchwork worker`` spends on its own loops (fetch and outbox timers,
watch, store): the fixed cost a worker loses to a plain loop when it gets only a share of the machine.
"""

from __future__ import annotations

import time

from bench import harness as h


def main() -> None:
    parser = h.arguments(__doc__)
    parser.add_argument("--seconds", type=float, default=20, help="how long to measure the idle worker")
    args = parser.parse_args()
    with h.stack() as found:
        worker = h.worker(found, "idle")
        worker.wait_ready()
        time.sleep(3)  # past its start-up
        before, started = h.group_cpu_s(worker.pid), time.monotonic()
        time.sleep(args.seconds)
        used = h.group_cpu_s(worker.pid) - before
        print(f"idle noop worker: {used / (time.monotonic() - started):.3f} cores over {args.seconds:g} s")


if __name__ == "__main__":
    main()
