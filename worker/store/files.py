"""Files and batches of the OpenAI-compatible surface in SQL: file bytes as chunk rows in the database (so
every API process sees them and a backup holds them), batch rows advanced under a lease.

Plain values in and out; nothing here knows OpenAI's JSON shapes or the batch states' meaning beyond the
columns.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Connection, Engine, and_, delete, insert, or_, select, update

from worker.errors import InvalidInput
from worker.jsonl import BOM
from worker.store import tables
from worker.store.db import client_errors

CHUNK_BYTES = 4 * 2**20  # bytes per file_chunks row
READ_CHUNKS = 4  # chunk rows read per query when a file is served (a batch's output has many small ones)
COMMIT_BYTES = 32 * 2**20  # a large file is written in transactions of about this much
ACTIVE_STATES = ("validating", "in_progress", "finalizing", "cancelling")

_FILE = tables.files.c
_CHUNK = tables.file_chunks.c
_BATCH = tables.openai_batches.c


@dataclass(frozen=True, slots=True)
class FileRecord:
    id: str
    tenant: str
    filename: str
    purpose: str
    bytes: int
    created_at: datetime
    expires_at: datetime | None = None  # gone after this (a batch output's output_expires_after)


@dataclass(frozen=True, slots=True)
class Page:
    rows: list[Any]
    has_more: bool


def utcnow() -> datetime:
    return datetime.now(UTC)


class FileStore:
    def __init__(self, engine: Engine, url: str) -> None:
        self.engine = engine
        self.url = url

    def write_bytes(self, file_id: str, pieces: Iterable[bytes]) -> int:
        """Store ``pieces`` as the bytes of ``file_id`` (replacing any chunks a crashed writer left); the
        number of bytes. The file is not listed until ``add`` records it."""
        writer = self.writer(file_id)
        for piece in pieces:
            writer.write(piece)
        return writer.close()

    def writer(self, file_id: str) -> ChunkWriter:
        return ChunkWriter(self, file_id)

    def drop_bytes(self, file_id: str) -> None:
        with client_errors(self.url), self.engine.begin() as conn:
            conn.execute(delete(tables.file_chunks).where(_CHUNK.file_id == file_id))

    @staticmethod
    def add(conn: Connection, record: FileRecord) -> None:
        conn.execute(insert(tables.files), [_file_row(record)])

    def create(self, record: FileRecord, pieces: Iterable[bytes]) -> FileRecord:
        """Write the bytes, then list the file (its ``bytes`` as counted); an upload that breaks off (or is
        refused part way) leaves no chunks behind."""
        try:
            size = self.write_bytes(record.id, pieces)
        except BaseException:
            self.drop_bytes(record.id)
            raise
        stored = replace(record, bytes=size)
        with client_errors(self.url), self.engine.begin() as conn:
            self.add(conn, stored)
        return stored

    def get(self, file_id: str, tenants: Collection[str]) -> FileRecord | None:
        query = select(tables.files).where(_FILE.id == file_id, _FILE.tenant.in_(list(tenants)), _unexpired())
        with client_errors(self.url), self.engine.connect() as conn:
            row = conn.execute(query).one_or_none()
        return None if row is None else FileRecord(**row._asdict())

    def page(
        self, tenants: Collection[str], purpose: str | None, after: str | None, limit: int, newest_first: bool
    ) -> Page:
        query = select(tables.files).where(_FILE.tenant.in_(list(tenants)), _unexpired())
        if purpose is not None:
            query = query.where(_FILE.purpose == purpose)
        with client_errors(self.url), self.engine.connect() as conn:
            rows = conn.execute(_keyset(query, tables.files, tenants, after, limit, newest_first, conn)).all()
        return Page([FileRecord(**row._asdict()) for row in rows[:limit]], len(rows) > limit)

    def content(self, file_id: str) -> Iterator[bytes]:
        """The file's bytes a chunk at a time, READ_CHUNKS chunks a short query."""
        seq = 0
        while True:
            query = (
                select(_CHUNK.data)
                .where(_CHUNK.file_id == file_id, _CHUNK.seq >= seq, _CHUNK.seq < seq + READ_CHUNKS)
                .order_by(_CHUNK.seq)
            )
            with client_errors(self.url), self.engine.connect() as conn:
                pieces = list(conn.scalars(query))
            for data in pieces:
                yield bytes(data)
            if len(pieces) < READ_CHUNKS:
                return
            seq += READ_CHUNKS

    @staticmethod
    def append(conn: Connection, file_id: str, seq: int, data: bytes) -> None:
        """One more chunk row of a file written piece by piece (a batch's output while its jobs run), in the
        caller's transaction."""
        conn.execute(insert(tables.file_chunks), [{"file_id": file_id, "seq": seq, "data": data}])

    def sweep_expired(self) -> int:
        """Delete the files whose ``expires_at`` has passed, bytes and all; how many."""
        with client_errors(self.url), self.engine.begin() as conn:
            gone = list(conn.scalars(select(_FILE.id).where(_FILE.expires_at < utcnow())))
            if gone:
                conn.execute(delete(tables.file_chunks).where(_CHUNK.file_id.in_(gone)))
                conn.execute(delete(tables.files).where(_FILE.id.in_(gone)))
        return len(gone)

    def lines(self, file_id: str) -> Iterator[bytes]:
        """The file's lines (without their newlines), across chunk edges; a leading UTF-8 BOM is dropped."""
        rest = b""
        first = True
        for data in self.content(file_id):
            if first:
                data = data.removeprefix(BOM)
                first = False
            lines = (rest + data).split(b"\n")
            rest = lines.pop()
            yield from lines
        if rest:
            yield rest

    def delete(self, file_id: str, tenants: Collection[str]) -> bool:
        with client_errors(self.url), self.engine.begin() as conn:
            gone = conn.execute(
                delete(tables.files).where(_FILE.id == file_id, _FILE.tenant.in_(list(tenants)))
            ).rowcount
            if gone:
                conn.execute(delete(tables.file_chunks).where(_CHUNK.file_id == file_id))
        return bool(gone)


class ChunkWriter:
    """Writes one file's bytes as chunk rows, committing about every COMMIT_BYTES."""

    def __init__(self, files: FileStore, file_id: str) -> None:
        self.files = files
        self.file_id = file_id
        self.size = 0
        self._seq = 0
        self._buffer = bytearray()
        self._pending: list[dict[str, Any]] = []
        files.drop_bytes(file_id)

    def write(self, data: bytes) -> None:
        self._buffer += data
        self.size += len(data)
        while len(self._buffer) >= CHUNK_BYTES:
            self._row(bytes(self._buffer[:CHUNK_BYTES]))
            del self._buffer[:CHUNK_BYTES]
            if len(self._pending) * CHUNK_BYTES >= COMMIT_BYTES:
                self._flush()

    def close(self) -> int:
        if self._buffer or self._seq == 0:
            self._row(bytes(self._buffer))
            self._buffer.clear()
        self._flush()
        return self.size

    def _row(self, data: bytes) -> None:
        self._pending.append({"file_id": self.file_id, "seq": self._seq, "data": data})
        self._seq += 1

    def _flush(self) -> None:
        if self._pending:
            with client_errors(self.files.url), self.files.engine.begin() as conn:
                conn.execute(insert(tables.file_chunks), self._pending)
            self._pending.clear()


class BatchStore:
    def __init__(self, engine: Engine, url: str) -> None:
        self.engine = engine
        self.url = url

    def create(self, row: dict[str, Any]) -> None:
        with client_errors(self.url), self.engine.begin() as conn:
            conn.execute(insert(tables.openai_batches), [row])

    def get(self, batch_id: str, tenants: Collection[str] | None = None) -> dict[str, Any] | None:
        query = select(tables.openai_batches).where(_BATCH.id == batch_id)
        if tenants is not None:
            query = query.where(_BATCH.tenant.in_(list(tenants)))
        with client_errors(self.url), self.engine.connect() as conn:
            row = conn.execute(query).one_or_none()
        return None if row is None else dict(row._mapping)

    def page(self, tenants: Collection[str], after: str | None, limit: int) -> Page:
        query = select(tables.openai_batches).where(_BATCH.tenant.in_(list(tenants)))
        with client_errors(self.url), self.engine.connect() as conn:
            query = _keyset(query, tables.openai_batches, tenants, after, limit, True, conn)
            rows = conn.execute(query).all()
        return Page([dict(row._mapping) for row in rows[:limit]], len(rows) > limit)

    def claimable(self) -> list[str]:
        """Batches some process must advance whose lease is free (never claimed, or run out)."""
        query = select(_BATCH.id).where(
            _BATCH.status.in_(ACTIVE_STATES),
            or_(_BATCH.claimed_until.is_(None), _BATCH.claimed_until < utcnow()),
        )
        with client_errors(self.url), self.engine.connect() as conn:
            return list(conn.scalars(query.order_by(_BATCH.created_at)))

    def claim(self, batch_id: str, owner: str, lease_s: float) -> dict[str, Any] | None:
        """Take the lease of an active batch (or renew one's own); the row, or None if another holds it."""
        now = utcnow()
        free = or_(_BATCH.claimed_until.is_(None), _BATCH.claimed_until < now, _BATCH.claimed_by == owner)
        stmt = (
            update(tables.openai_batches)
            .where(_BATCH.id == batch_id, _BATCH.status.in_(ACTIVE_STATES), free)
            .values(claimed_by=owner, claimed_until=now + timedelta(seconds=lease_s))
        )
        with client_errors(self.url), self.engine.begin() as conn:
            if conn.execute(stmt).rowcount != 1:
                return None
        return self.get(batch_id)

    def release(self, batch_id: str, owner: str) -> None:
        stmt = (
            update(tables.openai_batches)
            .where(_BATCH.id == batch_id, _BATCH.claimed_by == owner)
            .values(claimed_by=None, claimed_until=None)
        )
        with client_errors(self.url), self.engine.begin() as conn:
            conn.execute(stmt)

    def advance(
        self,
        batch_id: str,
        owner: str,
        from_states: Collection[str],
        conn: Connection | None = None,
        **values: Any,
    ) -> bool:
        """Set ``values`` on a batch still in one of ``from_states`` and still claimed by ``owner``."""
        stmt = (
            update(tables.openai_batches)
            .where(_BATCH.id == batch_id, _BATCH.status.in_(list(from_states)), _BATCH.claimed_by == owner)
            .values(**values)
        )
        if conn is not None:
            return bool(conn.execute(stmt).rowcount == 1)
        with client_errors(self.url), self.engine.begin() as own:
            return bool(own.execute(stmt).rowcount == 1)

    def record_written(
        self,
        conn: Connection,
        batch_id: str,
        owner: str,
        written: dict[str, Any],
        lease_s: float,
        **counts: int,
    ) -> bool:
        """Store the output writer's cursor (and the lines it counted) in ``conn``'s transaction, renewing
        the lease, if ``owner`` still holds the batch; False (write nothing then) otherwise."""
        stmt = (
            update(tables.openai_batches)
            .where(_BATCH.id == batch_id, _BATCH.status.in_(ACTIVE_STATES), _BATCH.claimed_by == owner)
            .values(written=written, claimed_until=utcnow() + timedelta(seconds=lease_s), **counts)
        )
        return bool(conn.execute(stmt).rowcount == 1)

    def active_using(self, file_id: str) -> bool:
        """Is the file the input of a batch not yet finished?"""
        query = select(_BATCH.id).where(_BATCH.input_file_id == file_id, _BATCH.status.in_(ACTIVE_STATES))
        with client_errors(self.url), self.engine.connect() as conn:
            return conn.execute(query.limit(1)).first() is not None

    def request_cancel(self, batch_id: str, tenants: Collection[str]) -> bool:
        """validating or in_progress -> cancelling (the lease holder, or the next, finishes it)."""
        stmt = (
            update(tables.openai_batches)
            .where(
                _BATCH.id == batch_id,
                _BATCH.tenant.in_(list(tenants)),
                _BATCH.status.in_(("validating", "in_progress")),
            )
            .values(status="cancelling", cancelling_at=utcnow())
        )
        with client_errors(self.url), self.engine.begin() as conn:
            return bool(conn.execute(stmt).rowcount == 1)


def _keyset(
    query: Any,
    table: Any,
    tenants: Collection[str],
    after: str | None,
    limit: int,
    newest_first: bool,
    conn: Connection,
) -> Any:
    """``query`` ordered by (created_at, id), newest or oldest first, from the row after ``after``: one of
    ``tenants``' rows (expired too: a listing may outlive the row it stopped at), else InvalidInput. Read
    from the first page again, a client would loop or see rows twice; another tenant's id reveals nothing."""
    created, ident = table.c.created_at, table.c.id
    if after is not None:
        found = select(created).where(ident == after, table.c.tenant.in_(list(tenants)))
        anchor = conn.execute(found).scalar_one_or_none()
        if anchor is None:
            raise InvalidInput(f"after: {after!r} is none of yours to list from (deleted, or never one)")
        if newest_first:
            query = query.where(or_(created < anchor, and_(created == anchor, ident < after)))
        else:
            query = query.where(or_(created > anchor, and_(created == anchor, ident > after)))
    order = (created.desc(), ident.desc()) if newest_first else (created.asc(), ident.asc())
    return query.order_by(*order).limit(limit + 1)


def _unexpired() -> Any:
    return or_(_FILE.expires_at.is_(None), _FILE.expires_at > utcnow())


def _file_row(record: FileRecord) -> dict[str, Any]:
    return {
        "id": record.id,
        "tenant": record.tenant,
        "filename": record.filename,
        "purpose": record.purpose,
        "bytes": record.bytes,
        "created_at": record.created_at,
        "expires_at": record.expires_at,
    }
