"""How producers enqueue: a call's messages (Celery's message format, JSON) and, for ``infer.delay``, the
job's record, in one Redis round trip.

Celery's own publish path costs a producer about as much as the whole round trip here, so batchwork writes the
same messages Celery would (protocol 2, any Celery worker can read them; worker/celery_compat.py)
straight to the queue lists. A job enqueued with ``record_job`` is known to Redis until a worker records it
in SQL (see ``PendingJobs``). Nothing here checks a call: callers have.
"""

from __future__ import annotations

import itertools
import os
import socket
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from datetime import UTC, datetime
from functools import lru_cache
from typing import Any

import orjson
import redis

from worker.broker import scripts
from worker.broker.keys import Keys
from worker.calls import TASK_NAME, NewJob
from worker.celery_compat import task_message
from worker.errors import BrokerUnavailable, InvalidInput

# A message stays under this many bytes of items (and at most BATCHWORK_SUBMIT_CHUNK_SIZE items), so one large
# input cannot make a message that blocks Redis, and a job of long texts still spreads across workers.
MAX_MESSAGE_BYTES = 1 << 20
# Messages sent in one pipeline at most: large submits go in several round trips of bounded size.
PIPELINE_MESSAGES = 64
# How long a job accepted by a producer stays known to Redis if no worker ever takes it.
PENDING_JOB_TTL_S = 7 * 86400


@lru_cache(maxsize=4)
def broker_unavailable(url: str, exc: Exception) -> BrokerUnavailable:
    """The one line for a broker that cannot be reached; its URL without a password (an API answers it)."""
    from worker.store.db import shown_url  # SQLAlchemy parses the URL; producers load it only here

    return BrokerUnavailable(f"cannot reach the broker at {shown_url(url)}: {exc}")


def broker_redis(url: str) -> redis.Redis:
    """The process's own Redis client on the broker (one connection pool, reused by every call).

    Never kombu's channel client: a worker's channel belongs to its consumer thread.
    """
    return redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5, health_check_interval=10)


class Publisher:
    """Sends calls as messages to the priority queues of one Redis broker."""

    def __init__(self, url: str, keys: Keys, chunk_size: int) -> None:
        self.url = url
        self.keys = keys
        self.chunk_size = chunk_size
        self.client = broker_redis(url)
        self._origin = f"{os.getpid()}@{socket.gethostname()}"
        self._record_and_push_script = self.client.register_script(scripts.RECORD_AND_PUSH)

    def enqueue(
        self,
        call: NewJob,
        *,
        task_id: str | None = None,
        record_job: bool = False,
        order: Sequence[int] | None = None,
    ) -> int:
        """Send ``call``'s items as messages (the first with ``task_id``), with the job's record when asked;
        returns how many messages. ``order``: the positions of the items in the order to send them (each
        message then names its items' indices). InvalidInput if an item is not JSON; BrokerUnavailable if
        Redis is not."""
        if order is None:
            chunks: Iterable[Part] = chunked_parts(call.inputs, call.offset, self.chunk_size)
        else:
            inputs, offset = call.inputs, call.offset
            encoded = (_json(inputs[position], offset + position) for position in order)
            chunks = ordered_parts([offset + position for position in order], encoded, self.chunk_size)
        return self.send(call, chunks, task_id=task_id, record_job=record_job)

    def send(
        self,
        call: NewJob,
        encoded_parts: Iterable[Part],
        *,
        task_id: str | None = None,
        record_job: bool = False,
    ) -> int:
        """Send one message per part of ``call``'s job, each ``(offset, its items' JSON joined by commas)``
        as ``parts`` makes them; ``call`` gives the job's fields, not the items. Returns how many messages."""
        queue = self.keys.queue(call.priority)
        sent = 0
        rest = iter(encoded_parts)
        first = next(rest, None)
        second = None if first is None else next(rest, None)
        if record_job and first is not None and second is None:
            return self._record_and_push(call, queue, self._kwargs(call, *first), task_id)
        parts = itertools.chain([part for part in (first, second) if part is not None], rest)
        try:
            pipe = self.client.pipeline(transaction=True)
            if record_job:
                pipe.hset(self.keys.job(call.job_id), mapping=_job_record(call))
                pipe.expire(self.keys.job(call.job_id), PENDING_JOB_TTL_S)
                pipe.zadd(self.keys.pending_jobs, {call.job_id: time.time()})
            for part in parts:
                # Only the job's first message may carry task_id (the job id, for Celery's result API).
                message_id = task_id if sent == 0 and task_id else str(uuid.uuid4())
                kwargs = self._kwargs(call, *part)
                pipe.lpush(queue, self._message(message_id, queue, kwargs, call))
                sent += 1
                if len(pipe) >= PIPELINE_MESSAGES:
                    pipe.execute()
            pipe.execute()
        except redis.RedisError as exc:
            raise broker_unavailable(self.url, exc) from exc
        return sent

    def _record_and_push(self, call: NewJob, queue: str, kwargs: bytes, task_id: str | None) -> int:
        """A one-message job and its record in one script call (``infer.delay``'s usual case)."""
        message = self._message(task_id or str(uuid.uuid4()), queue, kwargs, call)
        record = [value for pair in _job_record(call).items() for value in pair]
        keys = [self.keys.job(call.job_id), self.keys.pending_jobs, queue]
        try:
            self._record_and_push_script(
                keys=keys, args=[PENDING_JOB_TTL_S, time.time(), call.job_id, message, *record]
            )
        except redis.RedisError as exc:
            raise broker_unavailable(self.url, exc) from exc
        return 1

    @staticmethod
    def _kwargs(call: NewJob, offset: int, items: bytes, indices: list[int] | None = None) -> bytes:
        fields = call.fields()
        fields["offset"] = offset
        if indices is not None:
            fields["indices"] = indices
        head = orjson.dumps(fields)
        return head[:-1] + b',"inputs":[' + items + b"]}"

    def _message(self, task_id: str, queue: str, kwargs: bytes, call: NewJob) -> bytes:
        # What Flower shows for the task: a summary, never the inputs themselves.
        summary = f"{{'model': {call.model!r}, 'job_id': {call.job_id!r}}}"
        return task_message(TASK_NAME, task_id, queue, kwargs, kwargsrepr=summary, origin=self._origin)


class PendingJobs:
    """Jobs accepted by ``infer.delay`` that no worker has recorded in SQL yet, as Redis knows them.

    The producer writes the record with the job's messages; the worker that first stores one of its items
    creates the SQL row and then deletes the record. So a job is always in one of the two places (both for an
    instant), and the jobs port (worker/jobs.py) reads SQL, then Redis, then SQL again.
    """

    def __init__(self, url: str, keys: Keys) -> None:
        self.keys = keys
        self.client = broker_redis(url)
        self.url = url

    def get(self, job_id: str) -> dict[str, str] | None:
        try:
            record = self.client.hgetall(self.keys.job(job_id))
        except redis.RedisError as exc:
            raise broker_unavailable(self.url, exc) from exc
        return {_text(k): _text(v) for k, v in record.items()} or None

    def newest(self, before: float | None, count: int) -> list[tuple[str, dict[str, str]]]:
        """Up to ``count`` records, newest first, of jobs accepted before Unix time ``before`` (any: None)."""
        try:
            # redis-py types every reply as any of the shapes a reply may take
            found: list[bytes] = self.client.zrevrangebyscore(  # type: ignore[assignment]
                self.keys.pending_jobs, "+inf" if before is None else before, "-inf", start=0, num=count
            )
            ids = [_text(job_id) for job_id in found]
            pipe = self.client.pipeline(transaction=False)
            for job_id in ids:
                pipe.hgetall(self.keys.job(job_id))
            records = pipe.execute() if ids else []
        except redis.RedisError as exc:
            raise broker_unavailable(self.url, exc) from exc
        # A record gone since the first read: a worker recorded the job in SQL meanwhile.
        return [
            (job_id, {_text(k): _text(v) for k, v in record.items()})
            for job_id, record in zip(ids, records, strict=True)
            if record
        ]

    def forget(self, job_ids: list[str]) -> None:
        if job_ids:
            pipe = self.client.pipeline(transaction=False)
            pipe.delete(*(self.keys.job(job_id) for job_id in job_ids))
            pipe.zrem(self.keys.pending_jobs, *job_ids)
            pipe.execute()

    def all(self) -> dict[str, dict[str, str]]:
        """Every job record (``batchwork purge``): a SCAN of the keyspace, for an operator's rare command."""
        prefix = self.keys.job("")
        try:
            ids = [_text(key)[len(prefix) :] for key in self.client.scan_iter(f"{prefix}*", count=1000)]
            found = {job_id: self.get(job_id) for job_id in ids}
        except redis.RedisError as exc:
            raise broker_unavailable(self.url, exc) from exc
        return {job_id: record for job_id, record in found.items() if record is not None}


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _job_record(call: NewJob) -> dict[Any, Any]:
    created = datetime.fromtimestamp(call.created_at or 0, UTC) if call.created_at else datetime.now(UTC)
    return {
        "model": call.model,
        "priority": call.priority,
        "total": call.total,
        "created_at": created.isoformat(),
    }


# A message's part of a job: (offset, its items' JSON joined by commas), or (0, JSON, their job indices).
Part = tuple[int, bytes] | tuple[int, bytes, list[int]]


def ordered_parts(indices: list[int], encoded: Iterable[bytes], chunk_size: int) -> Iterator[Part]:
    """``parts`` of items sent out of index order: each names its items' job ``indices``."""
    pending: tuple[int, bytes] | None = None
    for start, joined in parts(0, encoded, chunk_size):
        if pending is not None:
            yield 0, pending[1], indices[pending[0] : start]
        pending = (start, joined)
    if pending is not None:
        yield 0, pending[1], indices[pending[0] :]


def parts(offset: int, encoded: Iterable[bytes], chunk_size: int) -> Iterator[tuple[int, bytes]]:
    """Items' JSON (the item at ``offset`` first) in messages' parts: ``(offset of the part, its items joined
    by commas)``, each of at most ``chunk_size`` items and about MAX_MESSAGE_BYTES."""
    group: list[bytes] = []
    size, start = 0, offset
    for position, item in enumerate(encoded, offset):
        if group and (len(group) >= chunk_size or size + len(item) > MAX_MESSAGE_BYTES):
            yield start, b",".join(group)
            group, size, start = [], 0, position
        group.append(item)
        size += len(item)
    if group:
        yield start, b",".join(group)


def chunked_parts(items: Sequence[Any], offset: int, chunk_size: int) -> Iterator[tuple[int, bytes]]:
    """``parts`` of ``items`` (the first at job index ``offset``), each written by one orjson call for the
    whole part (a JSON array is its items joined by commas, between brackets). From the first part that
    will not do (over MAX_MESSAGE_BYTES, or an item that is not JSON) on, the items go one by one through
    ``parts``, which splits by size and names the item at fault."""
    for start in range(0, len(items), chunk_size):
        chunk = items[start : start + chunk_size]
        try:
            joined = orjson.dumps(chunk if isinstance(chunk, list) else list(chunk))[1:-1]
        except TypeError:
            joined = None
        if joined is None or len(joined) + len(chunk) > MAX_MESSAGE_BYTES:
            rest = (_json(item, index) for index, item in enumerate(items[start:], offset + start))
            yield from parts(offset + start, rest, chunk_size)
            return
        yield offset + start, joined


def _json(item: Any, index: int) -> bytes:
    try:
        return orjson.dumps(item)
    except TypeError as exc:
        raise InvalidInput(f"the item is not a JSON value ({exc})", index) from None
