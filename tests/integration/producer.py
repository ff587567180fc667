"""A producer process for integration tests: reads jobs as JSON on stdin, prints their job ids.

Each job is {"via": "delay" | "submit", "model": ..., "inputs": [...], "priority": ..., "deadline_s": ...};
"delay"
is the plain Celery task call, "submit" the client's chunked submit.
"""

from __future__ import annotations

import json
import sys

from worker.client import submit
from worker.tasks import infer


def main() -> None:
    ids = []
    for job in json.load(sys.stdin):
        priority, deadline_s = job.get("priority", "normal"), job.get("deadline_s")
        if job["via"] == "delay":
            call = infer.delay(
                model=job["model"], inputs=job["inputs"], priority=priority, deadline_s=deadline_s
            )
            ids.append(call.id)
        else:
            ids.append(submit(job["model"], job["inputs"], priority, deadline_s))
    json.dump(ids, sys.stdout)


if __name__ == "__main__":
    main()
