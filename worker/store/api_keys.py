"""API keys: made here, shown once, kept only as their SHA-256, found by it, listed and revoked.

A key is ``bw_`` and 32 random bytes (URL-safe base64). It must never be stored, logged or returned after
``create``; nothing here knows about HTTP.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import Engine, String, bindparam, insert, select, update

from worker.errors import UsageError
from worker.store import tables
from worker.store.db import single_reads

KEY_PREFIX = "bw_"
DEFAULT_TENANT = "default"  # jobs submitted from Python (infer.delay, client.submit)
TENANT_PATTERN = re.compile(r"[a-z0-9][a-z0-9_.-]{0,63}")
KEY_ID_PATTERN = re.compile(r"[0-9a-f]{16}")  # what `keys list` shows; nothing else names a key


class InvalidTenant(UsageError):
    """A tenant name a key cannot be made for."""


@dataclass(frozen=True, slots=True)
class ApiKey:
    """What a key grants, never the key itself."""

    key_id: str
    tenant: str
    admin: bool
    created_at: datetime
    revoked_at: datetime | None

    @property
    def tenants(self) -> tuple[str, ...]:
        """Whose jobs this key sees: its own tenant's, and for an admin key the default tenant's too."""
        return (self.tenant, DEFAULT_TENANT) if self.admin else (self.tenant,)


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def check_tenant(tenant: str, admin: bool) -> None:
    if not TENANT_PATTERN.fullmatch(tenant):
        raise InvalidTenant(
            f"tenant {tenant!r}: use 1-64 of a-z, 0-9, '_', '.', '-', starting with a letter or digit"
        )
    if tenant == DEFAULT_TENANT and not admin:
        raise InvalidTenant(
            f"tenant {DEFAULT_TENANT!r} holds Python's jobs; any admin key (--admin) sees them"
        )


class KeyStore:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        # The API looks a key up on every request: one autocommit engine (making one per call cost a
        # second round trip) and one prebuilt statement.
        self._single_reads = single_reads(engine)

    def create(self, tenant: str, *, admin: bool = False) -> tuple[ApiKey, str]:
        """A new key of ``tenant``: what it grants, and the key itself (shown once, stored hashed)."""
        check_tenant(tenant, admin)
        key = KEY_PREFIX + secrets.token_urlsafe(32)
        record = ApiKey(secrets.token_hex(8), tenant, admin, datetime.now(UTC), None)
        row = {
            "id": record.key_id,
            "key_sha256": key_hash(key),
            "tenant": tenant,
            "admin": admin,
            "created_at": record.created_at,
        }
        with self.engine.begin() as conn:
            conn.execute(insert(tables.api_keys), row)
        return record, key

    def find(self, key: str) -> ApiKey | None:
        """The live key ``key`` is, or None (unknown or revoked).

        Looked up by its hash: a lookup that takes longer for some hash prefixes tells an attacker
        nothing about any key, since the keys are random and the hash is one-way.
        """
        with self._single_reads.connect() as conn:
            row = conn.execute(_FIND, {"key_sha256": key_hash(key)}).one_or_none()
        return None if row is None else ApiKey(*row)

    def all(self) -> list[ApiKey]:
        column = tables.api_keys.c
        with self.engine.connect() as conn:
            rows = conn.execute(select(*_COLUMNS).order_by(column.tenant, column.created_at)).all()
        return [ApiKey(*row) for row in rows]

    def revoke(self, key_id: str) -> bool:
        """Revoke a key at once; False when no live key has that id."""
        if not KEY_ID_PATTERN.fullmatch(key_id):
            return False
        column = tables.api_keys.c
        stmt = (
            update(tables.api_keys)
            .where(column.id == key_id, column.revoked_at.is_(None))
            .values(revoked_at=datetime.now(UTC))
        )
        with self.engine.begin() as conn:
            return conn.execute(stmt).rowcount == 1


_c = tables.api_keys.c
_COLUMNS = (_c.id, _c.tenant, _c.admin, _c.created_at, _c.revoked_at)
_FIND = select(*_COLUMNS).where(
    _c.key_sha256 == bindparam("key_sha256", type_=String()), _c.revoked_at.is_(None)
)
