"""The main job against plain sentence-transformers, as whole processes: ``batchwork run`` (embedded worker,
SQLite) on a mixed-length corpus vs ``encode(batch_size=32)`` (bench/st_encode.py), at fp32 and at each
lower precision given, in rounds (encode, then each precision) so a drift of the shared machine hits all.

Prints per precision the median wall time of each side, the median of the per-round ratios (encode /
run: above 1 means batchwork is faster) and the minimum cosine of batchwork's embeddings against encode's.
Never asserts. Run from the repository root: ``python -m bench.run_vs_encode [--items 1500] [--reps 3]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.minilm_batch_curve import corpus
from bench.services import remove_sqlite

ROOT = Path(__file__).resolve().parents[1]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--items", type=int, default=1500)
    parser.add_argument("--reps", type=int, default=3, help="counted rounds (one warm-up round)")
    parser.add_argument(
        "--precisions",
        default="fp32,bf16,int8",
        help="batchwork's precisions to compare (where the device runs them)",
    )
    parser.add_argument("--seed", type=int, default=5)
    return parser.parse_args()


def timed(command: list[str], env: dict[str, str], cwd: Path) -> float:
    started = time.perf_counter()
    done = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True)
    elapsed = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
    return elapsed


def embeddings(path: Path) -> np.ndarray:
    return np.array([json.loads(line)["output"] for line in path.read_text().splitlines()], dtype=np.float64)


def main() -> None:
    args = parse_args()
    work = Path(tempfile.mkdtemp(prefix="run_vs_encode_"))
    corpus_path = work / "corpus.jsonl"
    lines = [
        json.dumps({"id": f"d{i}", "text": text}) for i, text in enumerate(corpus(args.items, args.seed))
    ]
    corpus_path.write_text("\n".join(lines) + "\n")
    base = {k: v for k, v in os.environ.items() if not k.startswith("BATCHWORK_")}
    base.update(PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    encode = [sys.executable, "-m", "bench.st_encode", str(corpus_path), str(work / "st.jsonl")]
    print(f"{args.items} texts of 5-40 words; {args.reps} counted rounds after one warm-up; cwd {work}")
    print(f"{'precision':>10} {'run s':>8} {'encode s':>9} {'encode/run':>11} {'min cosine':>11}")
    precisions = [p for p in args.precisions.split(",") if runs_here(p)]
    runs: dict[str, list[float]] = {p: [] for p in precisions}
    ratios: dict[str, list[float]] = {p: [] for p in precisions}
    encodes: list[float] = []
    cosines: dict[str, float] = {}
    # Each round: encode, then every precision, so one encode and all runs share the machine's state.
    for rep in range(args.reps + 1):
        b = timed(encode, base, ROOT)
        for precision in precisions:
            remove_sqlite(work / "batchwork.db")
            a = timed(run_command(work, corpus_path), run_env(base, work, precision), ROOT)
            cosines[precision] = min_cosine(work / "run.jsonl", work / "st.jsonl")
            if rep:  # the first round warms the page cache and the file system for all
                runs[precision].append(a)
                ratios[precision].append(b / a)
        if rep:
            encodes.append(b)
    for precision in precisions:
        print(
            f"{precision:>10} {statistics.median(runs[precision]):8.2f} {statistics.median(encodes):9.2f} "
            f"{statistics.median(ratios[precision]):10.2f}x {cosines[precision]:11.6f}"
        )


def runs_here(precision: str) -> bool:
    """Whether this machine's device can run ``precision``; if not, one line says why and it is skipped."""
    from worker.models.device import resolve_device
    from worker.models.precision import UnsupportedPrecision, check_precision

    try:
        check_precision(precision, resolve_device("auto"))
    except UnsupportedPrecision as exc:
        print(f"{precision:>10} not measured: {exc}")
        return False
    return True


def run_command(work: Path, corpus_path: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "worker.cli",
        "run",
        str(corpus_path),
        "-m",
        "minilm",
        "-o",
        str(work / "run.jsonl"),
    ]


def run_env(base: dict[str, str], work: Path, precision: str) -> dict[str, str]:
    env = dict(base, BATCHWORK_DATABASE_URL=f"sqlite:///{work / 'batchwork.db'}")
    env["BATCHWORK_MODEL_OPTIONS"] = json.dumps({"minilm": {"precision": precision}})
    return env


def min_cosine(ours: Path, reference: Path) -> float:
    return float(np.min(np.sum(embeddings(ours) * embeddings(reference), axis=1)))


if __name__ == "__main__":
    main()
