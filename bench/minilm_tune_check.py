"""MiniLM's tuned limits on this machine, checked: ``batchwork tune minilm`` for two bounds, then the main
job (``batchwork run``, embedded worker) at each recommendation and at the default limits, alternating.

Prints the two recommendations (the tune tables and CSV/JSON/PNG paths) and, per configuration, the
median items/s of the whole run and the p99 batch run time of the batches it stored. Never asserts.
Run from the repository root: ``python -m bench.minilm_tune_check [--bounds 100,500] [--reps 2]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
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
    parser.add_argument("--bounds", default="100,500", help="--max-batch-ms values to tune for")
    parser.add_argument("--reps", type=int, default=2, help="runs per configuration, alternating")
    parser.add_argument("--point-s", default="1.0", help="tune's seconds per point")
    parser.add_argument("--out", type=Path, default=None, help="where tune writes (default: a temp dir)")
    parser.add_argument("--seed", type=int, default=5)
    return parser.parse_args()


def batchwork(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-m", "worker.cli", *args], env=env, cwd=ROOT, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"batchwork {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return done


def stored_batches(db: Path) -> tuple[int, float]:
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT size, run_ms FROM batches WHERE model = 'minilm'").fetchall()
    return len(rows), float(np.percentile([run_ms for _, run_ms in rows], 99))


def main() -> None:
    args = parse_args()
    work = Path(tempfile.mkdtemp(prefix="minilm_tune_"))
    out = args.out or work
    sample = work / "corpus.jsonl"
    texts = corpus(args.items, args.seed)
    sample.write_text("".join(json.dumps({"id": f"d{i}", "text": t}) + "\n" for i, t in enumerate(texts)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHWORK_")}
    env.update(PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", COLUMNS="120")
    # tune's T reads the stored batches' arrival rate: its own empty database, not the checkout's.
    env["BATCHWORK_DATABASE_URL"] = f"sqlite:///{work / 'tune.db'}"
    configs: dict[str, dict[str, object]] = {"default": {}}
    for bound in args.bounds.split(","):
        directory = out / f"L{bound}"
        done = batchwork(
            env,
            "tune",
            "minilm",
            "--max-batch-ms",
            bound,
            "--sample",
            str(sample),
            "--point-s",
            args.point_s,
            "-o",
            str(directory),
        )
        print(f"== batchwork tune minilm --max-batch-ms {bound} --sample corpus.jsonl -o {directory}")
        print(done.stdout)
        result = json.loads((directory / "tune.json").read_text())
        configs[f"L={bound}"] = {
            "max_batch_size": result["max_batch_size"],
            "max_batch_tokens": result["max_batch_tokens"],
        }
    rates: dict[str, list[float]] = {name: [] for name in configs}
    p99s: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(args.reps):
        for name, knobs in configs.items():
            db = work / f"{name}.db"
            remove_sqlite(db)
            run_env = dict(
                env,
                BATCHWORK_DATABASE_URL=f"sqlite:///{db}",
                BATCHWORK_BATCHING=json.dumps({"minilm": knobs}),
            )
            started = time.perf_counter()
            batchwork(run_env, "run", str(sample), "-m", "minilm", "-o", str(work / "out.jsonl"))
            rates[name].append(args.items / (time.perf_counter() - started))
            p99s[name].append(stored_batches(db)[1])
    header = f"{'config':>10} {'N':>5} {'tokens':>7} {'items/s':>9} {'p99 batch ms':>13}"
    print(f"{header}   (whole `batchwork run`, median of {args.reps})")
    for name, knobs in configs.items():
        print(
            f"{name:>10} {knobs.get('max_batch_size', '-')!s:>5} "
            f"{knobs.get('max_batch_tokens', '-')!s:>7} "
            f"{statistics.median(rates[name]):9.1f} {statistics.median(p99s[name]):13.1f}"
        )


if __name__ == "__main__":
    main()
