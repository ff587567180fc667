"""A job's results read back as NDJSON, the way ``GET /v1/jobs/{id}/results`` streams them: PostgreSQL writing
the lines itself (``ResultStore.result_lines``, what the route sends) beside rows read into ItemOutcomes and
written by ``worker.jsonl.write_results`` (what the route did before), alternating, on one schema.

    python -m bench.results_stream [--rows 1000000] [--reps 2]

It stores ``--rows`` results of one job (384-float outputs would make it a disk bench: the outputs are
small objects), then reads them back whole with each way in turn, and prints rows/s and the reading
process's peak RSS growth (memory must stay flat: pages, never the job). No HTTP: the route only passes the
chunks on. Starts a PostgreSQL (and a Redis) of its own.
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
        url = found.database_url
        from worker.jsonl import write_results
        from worker.store.results import JobSpec, ResultStore
        from worker.store.values import ItemColumns

        store = ResultStore.from_url(url)
        job = JobSpec(str(uuid.uuid4()), "noop", "normal", args.rows)
        store.create_job(job)
        started = time.perf_counter()
        for start in range(0, args.rows, 20_000):
            indices = list(range(start, min(args.rows, start + 20_000)))
            outputs = [{"label": "positive", "score": 0.5 + i % 100 / 1000} for i in indices]
            ids, nothing = [f"doc-{i}" for i in indices], [None] * len(indices)
            columns = ItemColumns([job.job_id] * len(indices), indices, ids, outputs, nothing)
            store.write_batches([(None, columns, [job])])
        print(f"stored {args.rows:,} rows in {time.perf_counter() - started:.1f} s")

        def sql_lines() -> int:
            return sum(len(chunk) for chunk in store.result_lines(job.job_id))

        def python_lines() -> int:  # as the route did: chunks of 1,000 lines
            outcomes, size = store.results(job.job_id), 0
            while chunk := list(islice(outcomes, 1000)):
                out = io.BytesIO()
                write_results(out, chunk)
                size += len(out.getvalue())
            return size

        runs: dict[str, list[tuple[float, int]]] = {"result_lines (SQL)": [], "results + write_results": []}
        for _ in range(args.reps):
            for name, read in (("result_lines (SQL)", sql_lines), ("results + write_results", python_lines)):
                before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                started = time.perf_counter()
                size = read()
                seconds = time.perf_counter() - started
                grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
                runs[name].append((args.rows / seconds, size))
                print(
                    f"  {name}: {seconds:.2f} s, {size / 1e6:.0f} MB NDJSON, peak RSS +{grown / 1024:.0f} MB"
                )
        best = {name: max(rate for rate, _ in rows) for name, rows in runs.items()}
        h.print_table(["way", "rows/s (best)"], [[name, f"{rate:,.0f}"] for name, rate in best.items()])
        print(f"  ratio SQL / Python: {best['result_lines (SQL)'] / best['results + write_results']:.2f}x")
        store.close()


if __name__ == "__main__":
    main()
