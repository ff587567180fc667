"""A job's results read back as NDJSON as ``GET /v1/jobs/{id}/results`` streams them: PostgreSQL writing the
lines (``ResultStore.result_lines``, what the route sends) vs rows read into outcomes and written by
``write_results`` (what it did before), alternating; rows/s and peak RSS growth (memory must stay flat).
"""

from __future__ import annotations

import io
import resource
import time
import uuid
from itertools import islice

from bench import harness as h


def main() -> None:
    p = h.arguments(__doc__)
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--reps", type=int, default=2)
    args = p.parse_args()
    h.header("bench.results_stream", args)
    with h.stack() as found:
        from worker.jsonl import write_results
        from worker.store.results import JobSpec, ResultStore
        from worker.store.values import ItemColumns

        store = ResultStore.from_url(found.database_url)
        job = JobSpec(str(uuid.uuid4()), "noop", "normal", args.rows)
        store.create_job(job)
        started = time.perf_counter()
        for start in range(0, args.rows, 20_000):  # small outputs: 384 floats would make it a disk bench
            indices = list(range(start, min(args.rows, start + 20_000)))
            outputs = [{"label": "positive", "score": 0.5 + i % 100 / 1000} for i in indices]
            ids, nothing = [f"doc-{i}" for i in indices], [None] * len(indices)
            columns = ItemColumns([job.job_id] * len(indices), indices, ids, outputs, nothing)
            store.write_batches([(None, columns, [job])])
        print(f"stored {args.rows:,} rows in {time.perf_counter() - started:.1f} s")

        def python_lines() -> int:  # as the route did: chunks of 1,000 lines
            outcomes, size = store.results(job.job_id), 0
            while chunk := list(islice(outcomes, 1000)):
                out = io.BytesIO()
                write_results(out, chunk)
                size += len(out.getvalue())
            return size

        ways = {"result_lines (SQL)": lambda: sum(map(len, store.result_lines(job.job_id))),
                "results + write_results": python_lines}  # fmt: skip
        best = dict.fromkeys(ways, 0.0)
        for _ in range(args.reps):
            for name, read in ways.items():
                before, started = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, time.perf_counter()
                size = read()
                seconds = time.perf_counter() - started
                grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
                best[name] = max(best[name], args.rows / seconds)
                print(
                    f"  {name}: {seconds:.2f} s, {size / 1e6:.0f} MB NDJSON, peak RSS +{grown / 1024:.0f} MB"
                )
        h.print_table(["way", "rows/s (best)"], [[name, f"{rate:,.0f}"] for name, rate in best.items()])
        print(f"  ratio SQL / Python: {best['result_lines (SQL)'] / best['results + write_results']:.2f}x")
        store.close()


if __name__ == "__main__":
    main()
