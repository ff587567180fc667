"""`batchwork run` of generated noop files on the embedded default, as whole processes: peak RSS (the child's
own, ``wait4``), wall and CPU seconds, the items/s it prints and lines/s over the command, every output line
checked once and in order. ``--old DIR``: another checkout's code beside this one, up to ``--old-max-lines``.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

from bench import harness as h
from tests.support.processes import batchwork_command


def write_input(path: Path, lines: int) -> None:
    with path.open("wb") as out:
        for start in range(0, lines, 10_000):
            out.write(b"".join(b'{"id": "d%d", "text": "a short text of a few words, number %d"}\n' % (i, i)
                               for i in range(start, min(lines, start + 10_000))))  # fmt: skip


def run_once(source: Path, folder: Path, lines: int) -> str:
    """One run of ``source``'s code in ``folder`` (its own SQLite file): the table's cells after the name."""
    for stale in folder.glob("batchwork.db*"):
        stale.unlink()
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHWORK_")}
    env.update(PYTHONPATH=str(source), HF_HUB_OFFLINE="1", BATCHWORK_MAX_ITEMS_PER_JOB=str(max(lines, 1)))
    ran = h.whole_run(batchwork_command("run", "in.jsonl", "-m", "noop", "-o", "out.jsonl"), env, folder)
    if ran.returncode != 0:
        raise SystemExit(f"run failed ({source}):\n{ran.stderr[-2000:]}")
    printed = re.search(r"\(([\d,]+) items/s\)", ran.stderr)
    items_s = float(printed.group(1).replace(",", "")) if printed else float("nan")
    return (f"{lines:>10,} {ran.peak_rss_mb:>12,.0f} {ran.wall_s:>8.1f} {ran.cpu_s:>8.1f} {items_s:>18,.0f} "
            f"{lines / ran.wall_s:>15,.0f}  {check_output(folder / 'out.jsonl', lines)}")  # fmt: skip


def check_output(path: Path, lines: int) -> str:
    """Every line once, in order (index i on line i), without holding the file."""
    count = 0
    with path.open("rb") as out:
        for count, line in enumerate(out, start=1):  # noqa: B007
            if not line.startswith(b'{"index":%d,' % (count - 1)):
                return f"line {count} out of order"
    return "ok" if count == lines else f"{count} lines of {lines}"


def main() -> None:
    parser = h.arguments(__doc__)
    parser.add_argument("--lines", default="1000000,10000000")
    parser.add_argument("--old", type=Path, help="another checkout's root, run beside this one")
    parser.add_argument("--old-max-lines", type=int, default=1_000_000)
    args = parser.parse_args()
    print(f"{'code':<6} {'lines':>10} {'peak RSS MB':>12} {'wall s':>8} {'CPU s':>8} "
          f"{'items/s (printed)':>18} {'lines/s (wall)':>15}  output")  # fmt: skip
    for lines in [int(n) for n in args.lines.split(",")]:
        with tempfile.TemporaryDirectory(prefix="bench-run-") as tmp:
            write_input(Path(tmp) / "in.jsonl", lines)
            old = [("old", args.old)] if args.old is not None and lines <= args.old_max_lines else []
            for name, source in [("new", h.ROOT), *old]:
                print(f"{name:<6} {run_once(source, Path(tmp), lines)}", flush=True)


if __name__ == "__main__":
    main()
