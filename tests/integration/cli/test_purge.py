"""`batchwork purge` ends every unfinished job as cancelled and empties the queues; `batchwork results` on an
unfinished job writes nothing unless asked for --partial. On SQLite and PostgreSQL, with no worker running,
so the jobs wait with their messages in the queues.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis

from tests.integration.processes import batchwork, produce, service_env
from worker.broker.keys import Keys
from worker.store.results import ResultStore
from worker.store.values import ItemRecord, JobSpec


@pytest.mark.parametrize("confirm", ["--yes", "-f", "-y"])
def test_purge_cancels_every_unfinished_job_and_empties_the_queues(
    redis_url: str, db_url: str, tmp_path: Path, confirm: str
) -> None:
    env = service_env(redis_url, db_url)
    client = redis.Redis.from_url(redis_url)
    store = ResultStore.from_url(db_url)
    try:
        submitted, delayed, high = produce(
            env,
            [
                {"via": "submit", "model": "noop", "inputs": ["a", "b", "c", "d"]},
                {"via": "delay", "model": "noop", "inputs": ["e", "f"]},
                {"via": "submit", "model": "noop", "inputs": ["g"], "priority": "high"},
            ],
        )
        # Half of one job ran before the purge: its outputs stay.
        spec = JobSpec(submitted, "noop", "normal", 4)
        store.write_batch(None, [ItemRecord(submitted, i, None, output=0) for i in (0, 2)], [spec])
        out = tmp_path / "out.jsonl"
        out.write_text("kept\n")

        refused = batchwork(tmp_path, "results", submitted, "-o", str(out), env=env, timeout_s=60)
        assert refused.returncode == 2
        assert refused.stderr.count("\n") == 1 and "is unfinished (running, 2 of 4" in refused.stderr
        assert out.read_text() == "kept\n"
        partial = batchwork(tmp_path, "results", submitted, "-o", str(out), "--partial", env=env)
        assert partial.returncode == 0, partial.stderr
        assert [json.loads(line)["index"] for line in out.read_text().splitlines()] == [0, 2]

        unconfirmed = batchwork(tmp_path, "purge", env=env, timeout_s=60)  # stdin is not a terminal
        assert unconfirmed.returncode == 2 and "pass --yes to confirm" in unconfirmed.stderr
        assert sum(client.llen(queue) for queue in Keys().queues) == 3

        purged = batchwork(tmp_path, "purge", confirm, env=env, timeout_s=60)
        assert purged.returncode == 0, purged.stderr
        assert "3 jobs cancelled; 3 messages removed" in purged.stderr
        assert sum(client.llen(queue) for queue in Keys().queues) == 0
        assert not client.exists(Keys().job(delayed)) and not client.zcard(Keys().pending_jobs)
        for job_id, total in ((submitted, 4), (delayed, 2), (high, 1)):
            status = store.status(job_id)
            assert status is not None and (status.state, status.total) == ("cancelled", total)
        outcomes = {r.index: (r.output, r.error) for r in store.results(submitted)}
        assert outcomes[0] == (0, None) and outcomes[2] == (0, None)
        assert all(outcomes[i][1] and outcomes[i][1].startswith("cancelled") for i in (1, 3))

        finished = batchwork(tmp_path, "results", delayed, "-o", str(out), env=env, timeout_s=60)
        assert finished.returncode == 0, finished.stderr
        assert [json.loads(line)["error"][:9] for line in out.read_text().splitlines()] == ["cancelled"] * 2
        again = batchwork(tmp_path, "purge", confirm, env=env, timeout_s=60)
        assert "0 jobs cancelled; 0 messages removed" in again.stderr
    finally:
        store.close()
        client.close()
