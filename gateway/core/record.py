"""The serialisable record of one sandbox: what a store keeps, what survives
a gateway restart, and what another node would need to take the sandbox over.

The live objects (runtime process, agent link, websockets) are not in it; the
record says how to get them back: ``runtime`` names the driver's handle on a
running sandbox, ``paused_image`` the running state on disk, ``head`` the
newest checkpoint.
"""

from __future__ import annotations

import time
from typing import Dict, List, Optional

from pydantic import BaseModel, Field, field_serializer

from ..drivers.base import Limits
from ..egress.policy import EgressPolicy
from ..egress.secrets import Secret
from .states import State


class SandboxRecord(BaseModel):
    id: str
    owner: str = ""  # the tenant that created it ("" until tenants exist)
    kernel_name: str  # the kernelspec it was started with
    driver: str
    state: State = State.STARTING
    node: str = "local"
    head: Optional[str] = None  # newest checkpoint in this sandbox's line
    origin: Optional[str] = None  # the checkpoint it was started (forked) from
    parent: Optional[str] = None  # the sandbox that checkpoint was taken from
    limits: Limits = Limits()
    labels: Dict[str, str] = {}
    env: Dict[str, str] = {}
    # Egress on: the agent's proxy listener port inside the sandbox (core/tunnel.py); None: no egress.
    egress_port: Optional[int] = None
    egress: Optional[EgressPolicy] = None  # what the proxy lets it reach; None: no network at all
    # What the proxy adds for it (gateway/egress/secrets.py). The values are kept here, in the gateway's
    # own store, for the proxy after a restart; no API answer is made from a record.
    secrets: List[Secret] = []
    created: float = Field(default_factory=time.time)
    expires: Optional[float] = None  # epoch seconds; the culler deletes it after
    runtime: Optional[str] = None  # the driver's id of the running sandbox (runsc container, VM)
    paused_image: Optional[str] = None  # running state on disk while paused (to disk)
    pause_mode: Optional[str] = None  # "disk" | "memory" while paused or frozen
    # Set when the running state is gone (a gateway killed mid-flight): the
    # sandbox resumes from this checkpoint instead, and ``reason`` says so.
    resume_from: Optional[str] = None
    reason: Optional[str] = None  # why it is dead, or what a recovery cost
    version: int = 0  # bumped by the store on every write

    @field_serializer("secrets")
    def _keep_values(self, secrets: List[Secret]) -> list:
        return [{**s.model_dump(exclude={"value"}), "value": s.value.get_secret_value()} for s in secrets]


class TenantRecord(BaseModel):
    """One tenant, as the store keeps it: the token only as a keyed hash."""

    name: str
    token_hash: str  # hex of HMAC-SHA-256 under the gateway's tenant key (core/tenants.py)
    salt: str  # hex
    # How token_hash was made: "hmac-sha256", or "scrypt-n16384-r8-p1" for a record from before it
    # (rewritten at its tenant's first good token).
    kdf: str = "scrypt-n16384-r8-p1"
    key_id: str = ""  # which key made an HMAC (core/tenants.py key_id): not the key
    max_sandboxes: Optional[int] = None  # None: the gateway's default (SANDGATE_TENANT_MAX_SANDBOXES)
    max_memory_mb: Optional[int] = None  # None: SANDGATE_TENANT_MAX_MEMORY_MB
    max_checkpoint_mb: Optional[int] = None  # None: SANDGATE_TENANT_MAX_CHECKPOINT_MB
    created: float = Field(default_factory=time.time)


class NotebookSessionRecord(BaseModel):
    """A Jupyter session (/api/sessions): a notebook path bound to a kernel,
    kept in the store so every node of a fleet sees it and a restart keeps it.
    ``owner`` is the tenant ("" for the admin); a path is held by at most one
    of an owner's sessions."""

    id: str
    owner: str = ""
    path: str
    name: str = ""
    type: str = "notebook"
    kernel_id: str
