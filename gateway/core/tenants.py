"""Tenants: who a caller is, and what a tenant may have.

The serve token is the admin. A tenant is a name with a token of its own
(``sgt.<name>.<secret>``), made by the admin and shown once; the store keeps
only a keyed hash (HMAC-SHA-256) of the secret (``TenantRecord``). A request's
caller is a ``Principal``: the admin (sees everything) or one tenant (sees
only what it owns). Scoping itself is in core/service.py; this module holds
the principal, the token check, the records and the creation rate limit.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import re
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Set, Tuple

from pydantic import BaseModel, ConfigDict, Field

from ..config import Settings
from ..store.base import SessionStore
from .errors import Conflict, NotFound
from .record import TenantRecord

NAME = r"^[a-z0-9][a-z0-9_-]{0,62}$"
NAME_RE = re.compile(NAME)
TOKEN_PREFIX = "sgt"
# A token's secret is 32 random bytes: a keyed fast hash protects it as well as a slow KDF (which is for
# guessable passwords), and a bogus token costs the gateway microseconds, not an scrypt.
KDF = "hmac-sha256"
LEGACY_KDF = "scrypt-n16384-r8-p1"  # records made before; checked once, then rewritten with the HMAC
KEY_FILE = "tenant.key"

log = logging.getLogger("sandgate")


@dataclass(frozen=True)
class Principal:
    """The caller of a service method: the admin (``tenant`` None) or one tenant."""

    tenant: Optional[str] = None

    @property
    def admin(self) -> bool:
        return self.tenant is None

    @property
    def owner(self) -> str:
        """What its sandboxes and checkpoints record as their owner ("" for the admin)."""
        return self.tenant or ""

    def sees(self, owner: str) -> bool:
        return self.tenant is None or owner == self.tenant

    def __str__(self) -> str:
        return "admin" if self.tenant is None else f"tenant {self.tenant}"


ADMIN = Principal()


class TenantCreate(BaseModel):
    """The body of POST /api/tenants; quotas not given are the gateway's defaults."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(..., pattern=NAME, description="lower-case letters, digits, '-' and '_'; at most 63")
    max_sandboxes: Optional[int] = Field(None, ge=0, le=100_000,
                                         description="sandboxes at once; 0 no quota (SANDGATE_TENANT_MAX_SANDBOXES)")
    max_memory_mb: Optional[int] = Field(None, ge=0, le=1 << 30,
                                         description="sum of its sandboxes' memory_mb; 0 no quota "
                                                     "(SANDGATE_TENANT_MAX_MEMORY_MB)")
    max_checkpoint_mb: Optional[int] = Field(None, ge=0, le=1 << 30,
                                             description="MB its checkpoints may store on disk; 0 no quota "
                                                         "(SANDGATE_TENANT_MAX_CHECKPOINT_MB)")


class TenantModel(BaseModel):
    """A tenant as the API shows it: never its token."""

    name: str
    max_sandboxes: int  # in force (its own, or the gateway's default); 0 = no quota
    max_memory_mb: int
    max_checkpoint_mb: int
    created: float
    sandboxes: int  # it has now
    memory_mb: int  # the sum of their memory_mb
    checkpoint_bytes: int  # what its checkpoints store on disk now (each blob and chunk once)


def token_key(settings: Settings) -> bytes:
    """The key tenant tokens are hashed with: ``SANDGATE_TENANT_KEY``; else, in a
    fleet, one derived from the fleet key every node has (not from the serve token:
    rotating that must not lock every tenant out); else a random key made once in
    the home (0600). Never in the store, so a copy of the store (a backup, a Redis
    dump) cannot even check a guess (docs/security.md#tenants)."""
    if settings.tenant_key:
        return hashlib.sha256(b"sandgate-tenant-key\0" + settings.tenant_key.encode()).digest()
    fleet_key = settings.fleet_secret() if settings.redis_url else None
    if fleet_key:
        return hmac.new(fleet_key.encode(), b"sandgate-tenant-key", "sha256").digest()
    return home_key(settings.home / KEY_FILE)


def home_key(path: Path) -> bytes:
    """32 random bytes kept in ``path`` (0600), made at the first start."""
    try:
        return read_key(path)
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(tmp, path)  # whole or absent: a key that changed would lock every tenant out
    except FileExistsError:
        pass
    finally:
        tmp.unlink()
    return read_key(path)


def read_key(path: Path) -> bytes:
    try:
        key = bytes.fromhex(path.read_text().strip())
    except ValueError:
        key = b""
    if len(key) != 32:
        raise ValueError(f"{path} is not a tenant key (64 hex digits); every tenant's token depends on it")
    return key


def key_id(key: bytes) -> str:
    """Names a key without revealing it: a record made under another key says so in the log."""
    return hmac.new(key, b"sandgate-tenant-key-id", "sha256").hexdigest()[:16]


def hmac_secret(key: bytes, name: str, secret: str, salt: bytes) -> str:
    return hmac.new(key, b"sgt\0" + name.encode() + b"\0" + salt + secret.encode(), "sha256").hexdigest()


def scrypt_secret(secret: str, salt: bytes) -> str:
    return hashlib.scrypt(secret.encode(), salt=salt, n=1 << 14, r=8, p=1, dklen=32).hex()


class TokenBucket:
    """``burst`` at once, then ``rate`` per second."""

    def __init__(self, rate: float, burst: int, now: float):
        self.rate, self.burst = rate, burst
        self.tokens, self.t = float(burst), now

    def take(self, now: float) -> float:
        """0 and one token taken, or the seconds until one is there (nothing taken)."""
        self.tokens = min(float(self.burst), self.tokens + max(0.0, now - self.t) * self.rate)
        self.t = now
        if self.tokens >= 1:
            self.tokens -= 1
            return 0.0
        return (1 - self.tokens) / self.rate


class Tenants:
    """Tenant records (in the session store), token checks, creation buckets."""

    def __init__(self, store: SessionStore, settings: Settings, clock: Callable[[], float] = time.monotonic):
        self.store = store
        self.settings = settings
        self.clock = clock
        self._key = token_key(settings)
        self.key_id = key_id(self._key)
        self._foreign_keys: Set[str] = set()  # key ids of records this key cannot check, logged once each
        # scrypt only for records from before the HMAC, once each: off the loop, one at a time, so a flood
        # of bogus tokens for such a tenant leaves the other core alone.
        self._legacy = asyncio.Semaphore(1)
        self._buckets: Dict[str, TokenBucket] = {}

    # -- records -------------------------------------------------------------------
    async def create(self, body: TenantCreate) -> Tuple[TenantRecord, str]:
        """A new tenant and its token (returned here only)."""
        secret = secrets.token_urlsafe(32)
        rec = self._hashed(TenantRecord(name=body.name, token_hash="", salt="", max_sandboxes=body.max_sandboxes,
                                        max_memory_mb=body.max_memory_mb, max_checkpoint_mb=body.max_checkpoint_mb),
                           secret)
        if not await self.store.create_tenant(rec):
            raise Conflict(f"tenant {body.name} exists", code="exists")
        return rec, f"{TOKEN_PREFIX}.{body.name}.{secret}"

    def _hashed(self, rec: TenantRecord, secret: str) -> TenantRecord:
        """``rec`` with ``secret``'s HMAC under this gateway's key."""
        salt = os.urandom(16)
        return rec.model_copy(update={"token_hash": hmac_secret(self._key, rec.name, secret, salt), "salt": salt.hex(),
                                      "kdf": KDF, "key_id": self.key_id})

    async def get(self, name: str) -> TenantRecord:
        rec = await self.store.get_tenant(name)
        if rec is None:
            raise NotFound(f"No such tenant: {name}")
        return rec

    async def list(self) -> List[TenantRecord]:
        return await self.store.list_tenants()

    async def delete(self, name: str) -> None:
        if not await self.store.delete_tenant(name):
            raise NotFound(f"No such tenant: {name}")
        self._buckets.pop(name, None)  # its token dies with the record: each check reads it

    def quotas(self, rec: TenantRecord) -> Tuple[int, int]:
        s = self.settings
        return (s.tenant_max_sandboxes if rec.max_sandboxes is None else rec.max_sandboxes,
                s.tenant_max_memory_mb if rec.max_memory_mb is None else rec.max_memory_mb)

    def checkpoint_quota(self, rec: TenantRecord) -> int:
        """MB its checkpoints may store; 0 = no quota."""
        s = self.settings
        return s.tenant_max_checkpoint_mb if rec.max_checkpoint_mb is None else rec.max_checkpoint_mb

    # -- authentication ------------------------------------------------------------
    async def authenticate(self, token: str) -> Optional[Principal]:
        """The tenant whose token this is, or None: a malformed token, an unknown
        name and a wrong secret are all None (the same 401). Each check reads the
        tenant's record, so a deleted or re-created tenant's old token fails at once."""
        kind, _, rest = token.partition(".")
        name, _, secret = rest.partition(".")
        if kind != TOKEN_PREFIX or not NAME_RE.fullmatch(name) or not secret:
            return None
        rec = await self.store.get_tenant(name)
        if rec is not None and rec.kdf == LEGACY_KDF:
            return await self._migrate(rec, secret)
        return Principal(name) if self._matches(rec, name, secret) else None

    def _matches(self, rec: Optional[TenantRecord], name: str, secret: str) -> bool:
        """An HMAC and a compare: microseconds, and as long for an unknown name."""
        if rec is None or rec.kdf != KDF:
            hmac.compare_digest(hmac_secret(self._key, name, secret, b"\0" * 16), "0" * 64)
            return False
        if rec.key_id != self.key_id:
            if rec.key_id not in self._foreign_keys:
                self._foreign_keys.add(rec.key_id)
                log.warning("tenant %s's token was hashed with another key (id %s; this gateway's is %s): its "
                            "token fails here; every node of a fleet needs the same SANDGATE_TENANT_KEY",
                            name, rec.key_id, self.key_id)
            return False
        return hmac.compare_digest(hmac_secret(self._key, name, secret, bytes.fromhex(rec.salt)), rec.token_hash)

    async def _migrate(self, rec: TenantRecord, secret: str) -> Optional[Principal]:
        """A record from before the HMAC: one scrypt, and if the secret is right
        the record is rewritten with the HMAC (compared against the old hash, so
        a tenant deleted or re-created meanwhile is left alone); from then on
        its tokens, right or bogus, cost no scrypt."""
        async with self._legacy:
            rec = await self.store.get_tenant(rec.name)  # another request may have rewritten it meanwhile
            if rec is None:
                return None
            if rec.kdf != LEGACY_KDF:
                return Principal(rec.name) if self._matches(rec, rec.name, secret) else None
            digest = await asyncio.to_thread(scrypt_secret, secret, bytes.fromhex(rec.salt))
            if not hmac.compare_digest(digest, rec.token_hash):
                return None
            if await self.store.replace_tenant(self._hashed(rec, secret), rec.token_hash):
                log.info("tenant %s: its token's hash is now %s (was %s)", rec.name, KDF, LEGACY_KDF)
        return Principal(rec.name)

    # -- creation rate ---------------------------------------------------------------
    def take_creation(self, name: str) -> float:
        """0 if the tenant may create a sandbox now (one taken from its
        bucket), else the seconds until it may."""
        s = self.settings
        if not s.tenant_create_rate:
            return 0.0
        now = self.clock()
        bucket = self._buckets.get(name)
        if bucket is None:
            bucket = self._buckets[name] = TokenBucket(s.tenant_create_rate / 60.0, s.tenant_create_burst, now)
        return bucket.take(now)
