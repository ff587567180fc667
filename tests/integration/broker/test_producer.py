"""The producer on a real Redis: a job recorded by ``infer.delay``'s path leaves the same record, lifetime,
pending entry and messages whether it is one message (one script call) or several (one transaction)."""

from __future__ import annotations

import base64
import uuid

import orjson
import pytest
import redis

from worker.broker.keys import Keys
from worker.broker.producer import PENDING_JOB_TTL_S, Publisher
from worker.calls import NewJob

KEYS = Keys("batchwork")


@pytest.mark.parametrize("items", [1, 3, 7])  # with chunks of 3: one message, one full, three
def test_a_recorded_job_is_the_same_in_redis_however_many_messages_it_takes(
    redis_url: str, items: int
) -> None:
    client = redis.Redis.from_url(redis_url)
    publisher = Publisher(redis_url, KEYS, chunk_size=3)
    call = NewJob(str(uuid.uuid4()), "noop", tuple(f"text {i}" for i in range(items)), "bulk", 0, items, None)
    sent = publisher.enqueue(call, task_id=call.job_id, record_job=True)
    assert sent == -(-items // 3) == client.llen(KEYS.queue("bulk"))
    record = {k.decode(): v.decode() for k, v in client.hgetall(KEYS.job(call.job_id)).items()}
    assert record.keys() == {"model", "priority", "total", "created_at"}
    assert (record["model"], record["priority"], record["total"]) == ("noop", "bulk", str(items))
    assert PENDING_JOB_TTL_S - 5 <= client.ttl(KEYS.job(call.job_id)) <= PENDING_JOB_TTL_S
    assert client.zscore(KEYS.pending_jobs, call.job_id) is not None
    # The messages hold every item once, the first under the job's own id (Celery's result API reads it).
    messages = [orjson.loads(raw) for raw in reversed(client.lrange(KEYS.queue("bulk"), 0, -1))]
    assert messages[0]["headers"]["id"] == call.job_id
    bodies = [orjson.loads(base64.b64decode(message["body"]))[1] for message in messages]
    assert [text for body in bodies for text in body["inputs"]] == list(call.inputs)
    client.close()
