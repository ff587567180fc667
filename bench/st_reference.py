"""The reference sides of bench/encoders_vs_references.py, each one whole process over a JSONL file, writing
one JSON line per input as ``batchwork run`` does: sentence-transformers ``encode(batch_size=32)`` of a
checkpoint directory (``--backend onnx`` for its own ONNX backend: the first run exports the model and saves
it in the directory's ``onnx/`` folder, later runs load that), or transformers'
``pipeline("text-classification", top_k=None)`` over the texts in batches of 32.

Run: ``python -m bench.st_reference encode|classify DIR IN.jsonl OUT.jsonl [--backend torch|onnx]``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import orjson


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("task", choices=["encode", "classify"])
    for name in ("directory", "source", "target"):
        parser.add_argument(name)
    parser.add_argument("--backend", default="torch")
    args = parser.parse_args()
    with open(args.source, "rb") as lines:
        texts = [orjson.loads(line)["text"] for line in lines if line.strip()]
    if args.task == "encode":
        outputs = encode(args.directory, texts, args.backend)
    else:
        outputs = classify(args.directory, texts)
    lines = (orjson.dumps({"index": i, "output": output}, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n"
             for i, output in enumerate(outputs))  # fmt: skip
    Path(args.target).write_bytes(b"".join(lines))


def encode(directory: str, texts: list[str], backend: str) -> list[object]:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(directory, device="cpu", backend=backend, local_files_only=True)
    if backend == "onnx" and not (Path(directory) / "onnx" / "model.onnx").exists():
        # The first load exported the model; saved as sentence-transformers advises, later loads read it.
        model.save_pretrained(directory)
    return list(model.encode(texts, batch_size=32, show_progress_bar=False))


def classify(directory: str, texts: list[str]) -> list[object]:
    from transformers import pipeline

    pipe = pipeline("text-classification", model=directory, top_k=None, device="cpu")
    # truncation=True: the pipeline truncates at the tokenizer's limit only when asked (it fails otherwise).
    results = pipe(texts, batch_size=32, truncation=True)
    return [{row["label"]: row["score"] for row in rows} for rows in results]


if __name__ == "__main__":
    main()
