"""The OpenAI surface vs batchwork's own client, one `batchwork worker` and one `batchwork api` on servers of
the bench's own (bench/README.md, "bench.openai_batch"): an embeddings batch file through the `openai` client
vs ``client.submit`` of its inputs, alternating, for noop and MiniLM; then ``POST /v1/embeddings`` clients.
"""

from __future__ import annotations

import argparse
import io
import statistics
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import orjson
from sqlalchemy import text

from bench import harness as h
from tests.support.services import free_port

POLL_S = 0.1


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = h.arguments(__doc__)
    p.add_argument("--items", type=int, default=50_000, help="lines of the noop batch")
    p.add_argument("--minilm-items", type=int, default=50_000, help="lines of the MiniLM batch (0: skip)")
    p.add_argument("--repeats", type=int, default=2, help="runs of each path, alternating")
    p.add_argument("--clients", type=int, default=32, help="concurrent POST /v1/embeddings clients")
    p.add_argument("--requests", type=int, default=40, help="requests per client")
    p.add_argument("--high-lane-n", type=int, default=32, help="minilm's high-lane N (0: the default, N/8)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    h.header("bench.openai_batch", args)
    with h.stack() as found:
        settings: dict[str, object] = {"api_max_queue_depth": str(10**6)}
        if args.high_lane_n:  # an embeddings server's setting: the high lane's batches as large as normal's
            settings["batching"] = {"minilm": {"lanes": {"high": {"max_batch_size": args.high_lane_n}}}}
        port = free_port()
        worker, api = h.worker(found, "worker", **settings), h.api(found, port, **settings)
        worker.wait_ready()
        api.wait_ready()
        from worker.client import Client
        from worker.store.api_keys import KeyStore

        key = KeyStore(Client().store.engine).create("bench")[1]
        print("\n1. an embeddings batch end to end: /v1/files + /v1/batches vs client.submit + results")
        models = {"noop": args.items, "minilm": args.minilm_items}
        rows = [batch_section(args, port, key, model, count) for model, count in models.items() if count]
        h.print_table(("model", "lines", "batch s (runs)", "submit s (runs)", "batch / submit speed"), rows)
        embeddings_section(args, found, port, key)
        h.print_problems([worker, api], limit=10)


def batch_section(args: argparse.Namespace, port: int, key: str, model: str, count: int) -> tuple[Any, ...]:
    import openai

    from worker.client import Client

    inputs = [f"document number {i} about batch inference on many machines" for i in range(count)]
    body = b"".join(orjson.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/embeddings",
                                  "body": {"model": model, "input": text}}) + b"\n"
                    for i, text in enumerate(inputs))  # fmt: skip
    oai = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=600)
    client = Client()
    seconds: dict[str, list[float]] = {"batch": [], "submit": []}
    for _ in range(args.repeats):
        seconds["submit"].append(submit_path(client, model, inputs))
        seconds["batch"].append(batch_path(oai, client, body, model, count))
    batch, submit = statistics.median(seconds["batch"]), statistics.median(seconds["submit"])
    runs = {name: " ".join(f"{value:.1f}" for value in values) for name, values in seconds.items()}
    return model, f"{count:,}", runs["batch"], runs["submit"], f"{submit / batch:.2f}x (target >= 0.8x)"


def submit_path(client: Any, model: str, inputs: list[str]) -> float:
    started = time.perf_counter()
    job_id = client.submit(model, inputs)
    client.wait(job_id, timeout_s=3600, poll_s=POLL_S)
    read = sum(1 for _ in client.results(job_id))
    elapsed = time.perf_counter() - started
    if read != len(inputs):
        raise RuntimeError(f"client.results gave {read} rows of {len(inputs)}")
    print(f"  submit of {len(inputs):,}: {job_times(client, job_id)}, read {elapsed:.1f}")
    return elapsed


def job_times(client: Any, job_id: str) -> str:
    """How long the job ran, first batch to finished, as the store saw it."""
    status = client.status(job_id)
    ran = (status.finished_at - status.started_at).total_seconds() if status.started_at else float("nan")
    return f"the job ran {ran:.1f} s (first batch to finished)"


def batch_path(oai: Any, client: Any, body: bytes, model: str, count: int) -> float:
    from api.batch_runner import job_id_for

    started = time.perf_counter()
    file_id = oai.files.create(file=("bench.jsonl", io.BytesIO(body)), purpose="batch").id
    seen = {"uploaded": time.perf_counter() - started}
    batch = oai.batches.create(input_file_id=file_id, endpoint="/v1/embeddings", completion_window="24h")
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        time.sleep(POLL_S)
        batch = oai.batches.retrieve(batch.id)
        seen.setdefault(batch.status, time.perf_counter() - started)
    if batch.status != "completed" or batch.output_file_id is None:
        raise RuntimeError(f"the batch ended {batch.status}: {batch.errors}")
    content = oai.files.content(batch.output_file_id).content
    read = sum(1 for line in content.splitlines() if orjson.loads(line)["response"]["status_code"] == 200)
    elapsed = time.perf_counter() - started
    if read != count:
        raise RuntimeError(f"the output held {read} answered lines of {count}")
    phases = ", ".join(f"{name} {at:.1f}" for name, at in seen.items())
    job = job_times(client, job_id_for(batch.id, model))
    print(f"  batch of {count:,}: first seen (s from the start): {phases}, downloaded {elapsed:.1f}; {job}")
    return elapsed


def embeddings_section(args: argparse.Namespace, found: h.Stack, port: int, key: str) -> None:
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}

    def post(number: int, i: int) -> h.Request:
        text = "warm up" if i < 0 else f"client {number} asks for request {i} about batching"
        return "POST", "/v1/embeddings", orjson.dumps({"model": "minilm", "input": text,
                                                       "encoding_format": "float"}), headers  # fmt: skip

    h.http_clients(port, 1, 0, post, warm=True)  # MiniLM loads on the first request
    latencies, wall, started = h.http_clients(port, args.clients, args.requests, post)
    query = text("SELECT size FROM batches WHERE model = 'minilm' AND lane = 'high' AND started_at >= :since")
    with found.db.connect() as conn:
        sizes = list(conn.execute(query, {"since": datetime.fromtimestamp(started, UTC)}).scalars())
    print(f"\n2. POST /v1/embeddings (MiniLM), {args.clients} concurrent clients of one input each")
    row = (len(latencies), f"{len(latencies) / wall:,.1f}",
           *(f"{h.percentile(latencies, q) * 1000:.0f}" for q in (50, 99)), len(sizes),
           f"{statistics.mean(sizes):.1f}" if sizes else "-", max(sizes) if sizes else "-")  # fmt: skip
    h.print_table(
        ("requests", "requests/s", "p50 ms", "p99 ms", "device batches", "mean batch size", "max"), [row]
    )


if __name__ == "__main__":
    main()
