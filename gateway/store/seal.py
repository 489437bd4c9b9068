"""Secret values at rest: sealed with AES-256-GCM before a record reaches a store.

A sandbox record carries its egress secrets' values (the proxy of whichever node holds it needs
them after a restart or a take-over). The stores keep them sealed: ``sgenc1:`` + base64 of a
12-byte nonce and the AES-GCM ciphertext, whose associated data binds the value to its sandbox id
and to the secret's host, header and name, so a value copied into another record, or a record
whose host was rewritten to send it elsewhere, does not open (``SealError``).

The key: in a fleet, derived (HKDF-SHA256) from the fleet key every node holds, since a record
moves between nodes; on a lone gateway, ``<home>/secrets.key`` (32 random bytes, 0600), made at
first use. A store records a check value of its key (``check``), so a node given another key
refuses to start rather than fail on every sealed record. A value without the prefix is a
record from before sealing: it reads as it is, and ``reseal`` rewrites it sealed.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import secrets
from pathlib import Path
from typing import Optional, Tuple

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from ..core.record import SandboxRecord

PREFIX = "sgenc1:"


class SealError(ValueError):
    """A sealed value that does not open: another key, or an altered record."""


def hkdf(key: bytes, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(key)


class Sealer:
    def __init__(self, key: bytes, source: str):
        if len(key) != 32:
            raise ValueError("a sealing key is 32 bytes")
        self._aead = AESGCM(key)
        self.source = source  # where the key came from, for messages
        self.check = hmac.new(key, b"sandgate-seal-check-v1", hashlib.sha256).hexdigest()[:32]

    @classmethod
    def from_fleet_key(cls, fleet_key: str) -> "Sealer":
        return cls(hkdf(fleet_key.encode(), b"sandgate secrets at rest v1"), "SANDGATE_FLEET_KEY")

    @classmethod
    def from_home(cls, home: Path) -> "Sealer":
        """``<home>/secrets.key``, made (0600) if missing: written whole to a temporary file, then linked
        into place, so a crash never leaves a short key and a second maker reads the first one's."""
        path = home / "secrets.key"
        if not path.exists():
            tmp = home / f".secrets.key.{os.getpid()}.{secrets.token_hex(4)}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(secrets.token_bytes(32))
                    f.flush()
                    os.fsync(f.fileno())
                try:
                    os.link(tmp, path)
                except FileExistsError:
                    pass  # made meanwhile: that one is the key
            finally:
                os.unlink(tmp)
        key = path.read_bytes()
        if len(key) != 32:
            raise SealError(f"{path} is not a 32-byte key ({len(key)} bytes)")
        return cls(key, str(path))

    @staticmethod
    def _aad(record_id: str, secret: dict) -> bytes:
        parts = (record_id, secret.get("host") or "", secret.get("header") or "", secret.get("name") or "")
        return "\0".join(("sandgate-secret-v1",) + parts).encode()

    def seal(self, value: str, record_id: str, secret: dict) -> str:
        nonce = secrets.token_bytes(12)
        sealed = self._aead.encrypt(nonce, value.encode(), self._aad(record_id, secret))
        return PREFIX + base64.b64encode(nonce + sealed).decode()

    def open(self, text: str, record_id: str, secret: dict) -> str:
        raw = base64.b64decode(text[len(PREFIX):])
        try:
            return self._aead.decrypt(raw[:12], raw[12:], self._aad(record_id, secret)).decode()
        except Exception:
            raise SealError(f"sandbox {record_id}: the value of its secret for {secret.get('host')} does not open "
                            f"with the key from {self.source}: another key sealed it, or the record was altered"
                            ) from None


def dump(record: SandboxRecord, sealer: Optional[Sealer]) -> str:
    """The record's JSON for a store, its secrets' values sealed."""
    text = record.model_dump_json()
    if not record.secrets:
        return text
    if sealer is None:
        raise SealError(f"sandbox {record.id}: this store has no key to seal secret values with")
    data = json.loads(text)
    for s in data["secrets"]:
        s["value"] = sealer.seal(s["value"], record.id, s)
    return json.dumps(data)


def load(raw: str, sealer: Optional[Sealer]) -> Tuple[SandboxRecord, bool]:
    """A stored record, its secrets opened; and whether any value was stored in clear (from
    before sealing, to be rewritten)."""
    data = json.loads(raw)
    clear = False
    for s in data.get("secrets") or []:
        value = s.get("value")
        if isinstance(value, str) and value.startswith(PREFIX):
            if sealer is None:
                raise SealError(f"sandbox {data.get('id')}: a sealed secret value, and this store has no key")
            s["value"] = sealer.open(value, data.get("id", ""), s)
        else:
            clear = True
    return SandboxRecord.model_validate(data), clear
