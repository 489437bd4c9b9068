"""Tenants: who a caller is, and what a tenant may have.

The serve token is the admin. A tenant is a name with a token of its own
(``sgt.<name>.<secret>``), made by the admin and shown once; the store keeps
only a salted scrypt hash of the secret (``TenantRecord``). A request's
caller is a ``Principal``: the admin (sees everything) or one tenant (sees
only what it owns). Scoping itself is in core/service.py; this module holds
the principal, the token check, the records and the creation rate limit.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import re
import secrets
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

from pydantic import BaseModel, ConfigDict, Field

from ..config import Settings
from ..store.base import SessionStore
from .errors import Conflict, NotFound
from .record import TenantRecord

NAME = r"^[a-z0-9][a-z0-9_-]{0,62}$"
NAME_RE = re.compile(NAME)
TOKEN_PREFIX = "sgt"
KDF = "scrypt-n16384-r8-p1"
VERIFIED_MAX = 10_000  # tokens remembered as checked, per process


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


def hash_secret(secret: str, salt: bytes) -> str:
    return hashlib.scrypt(secret.encode(), salt=salt, n=1 << 14, r=8, p=1, dklen=32).hex()


def _verify(secret: str, record: Optional[TenantRecord]) -> bool:
    if record is None or record.kdf != KDF:
        hash_secret(secret, b"\0" * 16)  # the same cost whether or not the name exists
        return False
    return hmac.compare_digest(hash_secret(secret, bytes.fromhex(record.salt)), record.token_hash)


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
        self._verified: Dict[bytes, str] = {}  # sha256(token) -> the token_hash it was checked against
        self._hashing = asyncio.Semaphore(2)  # scrypt runs off the loop, a couple at a time
        self._buckets: Dict[str, TokenBucket] = {}

    # -- records -------------------------------------------------------------------
    async def create(self, body: TenantCreate) -> Tuple[TenantRecord, str]:
        """A new tenant and its token (returned here only)."""
        secret = secrets.token_urlsafe(32)
        salt = os.urandom(16)
        async with self._hashing:
            digest = await asyncio.to_thread(hash_secret, secret, salt)
        rec = TenantRecord(name=body.name, token_hash=digest, salt=salt.hex(), kdf=KDF,
                           max_sandboxes=body.max_sandboxes, max_memory_mb=body.max_memory_mb,
                           max_checkpoint_mb=body.max_checkpoint_mb)
        if not await self.store.create_tenant(rec):
            raise Conflict(f"tenant {body.name} exists", code="exists")
        return rec, f"{TOKEN_PREFIX}.{body.name}.{secret}"

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
        self._buckets.pop(name, None)
        # Its verified tokens die with the record: each check compares the stored hash.

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
        """The tenant whose token this is, or None. A token checked once is
        remembered (by its sha256, in memory) against the hash it matched, so
        a deleted or re-created tenant's old token fails at once."""
        kind, _, rest = token.partition(".")
        name, _, secret = rest.partition(".")
        if kind != TOKEN_PREFIX or not NAME_RE.fullmatch(name) or not secret:
            return None
        rec = await self.store.get_tenant(name)
        key = hashlib.sha256(token.encode()).digest()
        if rec is not None and hmac.compare_digest(self._verified.get(key, ""), rec.token_hash):
            return Principal(rec.name)
        async with self._hashing:
            ok = await asyncio.to_thread(_verify, secret, rec)
        if not ok:
            return None
        if len(self._verified) >= VERIFIED_MAX:
            self._verified.clear()
        self._verified[key] = rec.token_hash
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
