"""The service layer: what every front end calls (the Jupyter REST and
websocket API, the sandbox API, and the E2B API, MCP server and SDK to come).

No tornado here. Requests arrive as validated pydantic models; answers leave
as plain dicts of the API models below; failures are core.errors classes,
which each front end maps once (api/base.py for HTTP).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import math
import re
import time
import uuid
from typing import AsyncIterator, Awaitable, Callable, Dict, List, Optional, Tuple

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..agent_link import AgentError
from ..checkpoints import Checkpoint, StoreQuota
from ..config import Settings
from ..drivers.base import Limits
from ..egress.policy import EgressPolicy
from ..egress.secrets import Secret, Secrets, placeholders
from .errors import (BadRequest, CeilingExceeded, Conflict, Forbidden, LimitReached, NotFound, QuotaExceeded,
                     RateLimited, SandgateError, TooLarge, Unavailable)
from .manager import SandboxManager
from .messages import utcnow
from .record import TenantRecord
from .sandbox import Sandbox
from .sessions import NotebookSessions
from .states import State
from .tenants import ADMIN, Principal, TenantCreate, TenantModel, Tenants

log = logging.getLogger("sandgate.service")


READ_CHUNK = 1 << 20  # a file read from the agent this much at a time

# -- request models (the edge validates; the core trusts) ---------------------
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
MAX_TTL = 10 * 365 * 86400  # beyond any ceiling an operator sets; keeps expiry a real date
# Labels (E2B's metadata) are kept in every record, listed with every sandbox and matched by E2B's
# list filter: a handful of short strings, bounded so that no caller can make them megabytes.
MAX_LABELS = 64
MAX_LABEL_KEY = 128  # characters
MAX_LABEL_VALUE = 1024


def check_labels(labels: object, field: str = "labels", most: int = MAX_LABELS) -> object:
    """Count and sizes, checked before the types so that a refusal never quotes a huge key."""
    if not isinstance(labels, dict):
        return labels  # the type check says what is wrong
    if len(labels) > most:
        raise ValueError(f"at most {most} keys, not {len(labels)}")
    for key, value in labels.items():
        if not isinstance(key, str) or not 0 < len(key) <= MAX_LABEL_KEY:
            size = len(key) if isinstance(key, str) else "?"
            raise ValueError(f"a key of {size} characters: {field} keys are 1-{MAX_LABEL_KEY} characters")
        if isinstance(value, str) and len(value) > MAX_LABEL_VALUE:
            raise ValueError(f"{key!r} has a value of {len(value)} characters: {field} values are at most "
                             f"{MAX_LABEL_VALUE} characters")
    return labels


class LimitsRequest(BaseModel):
    """Any subset; the rest are the gateway's defaults."""

    model_config = ConfigDict(extra="forbid")
    memory_mb: Optional[int] = Field(None, ge=64)
    cpus: Optional[float] = Field(None, gt=0, allow_inf_nan=False)
    pids: Optional[int] = Field(None, ge=16)
    disk_mb: Optional[int] = Field(None, ge=16)


class SandboxCreate(BaseModel):
    """The body of POST /api/sandboxes (and what other front ends ask for)."""

    # A secret's value must not come back in a 400 (gateway/egress/secrets.py).
    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)
    driver: Optional[str] = Field(None, description="sandbox driver; the server default when omitted")
    env: Dict[str, str] = Field({}, description="KERNEL_* (and allow-listed) variables for the sandbox")
    labels: Dict[str, str] = Field({}, description=f"at most {MAX_LABELS}; keys 1-{MAX_LABEL_KEY} characters, "
                                                 f"values up to {MAX_LABEL_VALUE}")
    limits: Optional[LimitsRequest] = Field(None, description="any subset; above an operator ceiling is a 400")
    ttl: Optional[float] = Field(None, gt=0, le=MAX_TTL, allow_inf_nan=False,
                                 description="seconds until the sandbox is deleted")
    checkpoint: Optional[str] = Field(None, description="start from this checkpoint instead of cold")
    egress: Optional[EgressPolicy] = Field(None, description="what it may reach through the egress proxy; "
                                           "omitted: no network at all (docs/egress.md)")
    secrets: Secrets = Field([], description="headers the proxy adds for it, and placeholders (write-only)")


    _labels = field_validator("labels", mode="before")(classmethod(lambda cls, v: check_labels(v)))


class StartRequest(SandboxCreate):
    """What the service starts: a create body, plus what the front end knows
    (the kernelspec). The owner is the caller's (the ``who`` of ``start``)."""

    kernel_name: Optional[str] = Field(None, description="kernelspec; the default when omitted")


# -- answer models --------------------------------------------------------------
class SandboxModel(BaseModel):
    id: str
    state: State  # the lifecycle state (core/states.py)
    pause_mode: Optional[str] = None  # disk | memory, while paused or frozen
    execution_state: str  # the kernel's: starting, idle, busy, restarting, paused, dead
    driver: str
    kernel_id: str
    runtime_id: Optional[str]  # the driver's name for the running sandbox (runsc list), none while paused
    parent: Optional[Dict[str, Optional[str]]]  # {"sandbox", "checkpoint"} it was forked from
    head: Optional[str]  # newest checkpoint in its line
    limits: Limits
    owner: str = ""  # the tenant it belongs to; "" for the admin's
    labels: Dict[str, str]
    created: str
    last_activity: str
    expires: Optional[str] = None
    resume_from: Optional[str] = None  # set when its running state was lost: it resumes from this checkpoint
    reason: Optional[str] = None  # why it is dead, or what a recovery cost
    egress: Optional[EgressPolicy] = None  # None: no network at all
    secrets: List[SecretModel] = []  # never their values


class SecretModel(BaseModel):
    """A secret as the API shows it: where it goes, never what it is."""

    host: str
    header: Optional[str] = None
    name: Optional[str] = None


SandboxModel.model_rebuild()


def sandbox_model(sb: Sandbox) -> dict:
    r, m = sb.record, sb.model()
    parent = {"sandbox": r.parent, "checkpoint": r.origin} if r.origin else None
    return SandboxModel(id=r.id, state=r.state, pause_mode=r.pause_mode, execution_state=sb.execution_state,
                        driver=r.driver, kernel_id=r.id, runtime_id=sb.runtime.id if sb.runtime else None,
                        parent=parent, head=r.head, limits=r.limits, owner=r.owner, labels=r.labels, created=m["created"],
                        last_activity=m["last_activity"], expires=m.get("expires"), resume_from=r.resume_from,
                        reason=r.reason, egress=r.egress,
                        secrets=[SecretModel(host=s.host, header=s.header, name=s.name) for s in r.secrets],
                        ).model_dump(mode="json")


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else str(v)


OutputCallback = Callable[[dict], Awaitable[None]]
BeginCallback = Callable[[str], Awaitable[None]]  # "new", "joined" or "finished": Executions.run


class SandboxService:
    """Every method takes the caller (``who``, a ``Principal``; the admin when
    omitted). A tenant reaches only what it owns: another's sandbox, kernel or
    checkpoint is NotFound, exactly as an id that does not exist, and lists
    leave it out. The admin reaches everything."""

    def __init__(self, manager: SandboxManager, clock=None):
        self.manager = manager
        self.settings: Settings = manager.settings
        self.tenants = Tenants(manager.store, self.settings, **({"clock": clock} if clock else {}))
        self._pending: Dict[str, tuple] = {}  # sandbox id -> (tenant, memory_mb) of starts in flight
        # One checkpoint at a time per tenant with a storage quota: each counts what the one before stored.
        self._storing: Dict[str, asyncio.Lock] = {}
        self.sessions = NotebookSessions(manager.store, lambda kid: manager.sandboxes.get(kid))

    # -- reading -------------------------------------------------------------------
    def get(self, sandbox_id: str, who: Principal = ADMIN) -> Sandbox:
        sb = self.manager.sandboxes.get(sandbox_id)
        if sb is None or not who.sees(sb.record.owner):
            raise NotFound(f"Sandbox does not exist: {sandbox_id}")
        return sb

    def list(self, who: Principal = ADMIN) -> List[Sandbox]:
        return [sb for sb in self.manager.list() if who.sees(sb.record.owner)]

    def kernelspecs(self) -> dict:
        return self.manager.specs.model()

    def has_kernelspec(self, name: str) -> bool:
        return name in self.manager.specs.specs

    def driver_names(self) -> List[str]:
        return list(self.manager.drivers)

    async def tenant_exists(self, name: str) -> bool:
        return await self.manager.store.get_tenant(name) is not None

    def kernelspec(self, name: str) -> dict:
        try:
            return self.manager.specs.get(name).model()
        except KeyError:
            raise NotFound(f"Kernel spec {name} not found") from None

    def checkpoint_get(self, cid: str, who: Principal = ADMIN) -> Checkpoint:
        try:
            cp = self.manager.checkpoints.get(cid)
        except (KeyError, ValueError, OSError):
            raise NotFound(f"No such checkpoint: {cid}") from None
        if not who.sees(cp.owner):
            raise NotFound(f"No such checkpoint: {cid}")
        return cp

    def checkpoints(self, sandbox_id: str, who: Principal = ADMIN) -> List[dict]:
        self.get(sandbox_id, who)
        return [c.summary() for c in self.manager.checkpoints.list(sandbox=sandbox_id, owner=who.tenant)]

    def tree(self, who: Principal = ADMIN) -> dict:
        nodes = [{"kind": "checkpoint", **c.summary()} for c in self.manager.checkpoints.list(owner=who.tenant)]
        nodes += [{"kind": "sandbox", "id": sb.id, "parent": sb.record.origin, "state": sb.state.value}
                  for sb in self.list(who)]
        return {"nodes": nodes}

    # -- creating ------------------------------------------------------------------
    def limits(self, requested: Optional[LimitsRequest]) -> Limits:
        """The gateway's defaults under what was asked; above a ceiling is a 400 naming it."""
        s = self.settings
        asked = requested.model_dump(exclude_none=True) if requested else {}
        for field, value in asked.items():
            ceiling = getattr(s, Settings.CEILINGS[field])
            if value > ceiling:
                raise CeilingExceeded(f"limits.{field} {_num(value)} is above this gateway's ceiling of {_num(ceiling)} "
                                      f"({Settings.ENV[Settings.CEILINGS[field]]})")
        return s.limits.model_copy(update=asked)

    def ttl(self, ttl: Optional[float]) -> Optional[float]:
        ceiling = self.settings.max_ttl
        if ceiling and ttl and ttl > ceiling:
            raise CeilingExceeded(f"ttl {_num(ttl)} s is above this gateway's ceiling of {_num(ceiling)} s (SANDGATE_MAX_TTL)")
        return ttl or ceiling or None

    def kernel_env(self, requested: Dict[str, str]) -> Dict[str, str]:
        """Only KERNEL_* and explicitly allowed names reach a sandbox."""
        allow = set(self.settings.env_allow)
        for k, v in requested.items():
            if not ENV_NAME.fullmatch(k) or "\0" in v:
                raise BadRequest(f"env: {k!r} is not a variable name, or its value holds a NUL byte")
        return {k: v for k, v in requested.items() if k.startswith("KERNEL_") or k in allow}

    def usage(self, tenant: str) -> tuple:
        """(sandboxes, memory_mb) a tenant has, counting starts in flight."""
        count = mem = 0
        for sb in self.manager.sandboxes.values():
            if sb.record.owner == tenant and sb.id not in self._pending:
                count, mem = count + 1, mem + sb.record.limits.memory_mb
        for owner, m in self._pending.values():
            if owner == tenant:
                count, mem = count + 1, mem + m
        return count, mem

    async def _admit(self, who: Principal, memory_mb: int) -> Optional[str]:
        """A tenant's quotas and creation rate, checked before a start: the id
        the new sandbox will have (counted from now on, until its start ends),
        or LimitReached naming the quota, or RateLimited. None for the admin."""
        if who.admin:
            return None
        rec = await self.tenants.get(who.tenant)
        max_sandboxes, max_memory = self.tenants.quotas(rec)
        count, mem = self.usage(who.tenant)  # from here to the reservation nothing awaits
        if max_sandboxes and count + 1 > max_sandboxes:
            raise LimitReached(f"tenant {who.tenant} has {count} sandboxes, its quota max_sandboxes is {max_sandboxes}")
        if max_memory and mem + memory_mb > max_memory:
            raise LimitReached(f"tenant {who.tenant}'s sandboxes would use {mem + memory_mb} MB of memory "
                               f"({mem} MB now + {memory_mb} MB), above its quota max_memory_mb of {max_memory}")
        wait = self.tenants.take_creation(who.tenant)
        if wait:
            raise RateLimited(f"tenant {who.tenant} creates sandboxes too fast: at most "
                              f"{_num(self.settings.tenant_create_rate)} a minute, {self.settings.tenant_create_burst} "
                              f"at once (SANDGATE_TENANT_CREATE_RATE); retry in {math.ceil(wait)} s", wait)
        sid = str(uuid.uuid4())
        self._pending[sid] = (who.tenant, memory_mb)
        return sid

    async def start(self, req: StartRequest, who: Principal = ADMIN) -> Sandbox:
        specs = self.manager.specs
        cp = self.checkpoint_get(req.checkpoint, who) if req.checkpoint else None
        name = req.kernel_name
        if req.driver:
            name = f"python3-{req.driver}"
            if name not in specs.specs:
                raise BadRequest(f"unknown or unavailable driver {req.driver!r}")
        source = self.manager.sandboxes.get(cp.sandbox) if cp else None
        if cp and not name:
            name = source.record.kernel_name if source else None
        try:
            spec = specs.get(name or specs.default)
        except KeyError:
            raise NotFound(f"No such kernel named {name}") from None
        limits = self.limits(req.limits)
        if req.limits and req.limits.disk_mb is not None and not self.manager.drivers[spec.driver].shares_workspace:
            raise BadRequest(f"limits.disk_mb cannot be set for the {spec.driver} driver: its workspace is the "
                             "VM image's own disk, of a fixed size (docs/drivers.md)")
        env = self.kernel_env(req.env)
        egress, secrets = req.egress, req.secrets
        if source and not req.limits:
            limits = source.record.limits  # a fork keeps its parent's limits...
        if source and not req.env:
            env = source.record.env  # ...environment...
        if source and egress is None and not secrets:
            egress, secrets = source.record.egress, source.record.secrets  # ...and network
        else:
            env = self.secret_env(env, egress, secrets)
        ttl = self.ttl(req.ttl)
        sid = await self._admit(who, limits.memory_mb)
        return await self._start(who, sid, spec.name, spec.driver, env, limits, req.labels, ttl, cp, who.owner,
                                 egress=egress, secrets=secrets)

    @staticmethod
    def secret_env(env: Dict[str, str], egress: Optional[EgressPolicy], secrets: List[Secret]) -> Dict[str, str]:
        """The environment plus a placeholder for each named secret (the proxy swaps it for the value)."""
        if secrets and egress is None:
            raise BadRequest("secrets: a sandbox without egress reaches no host to send them to; give it an egress policy")
        clash = sorted({s.name for s in secrets if s.name} & set(env))
        if clash:
            raise BadRequest(f"secrets: {clash[0]!r} is also in env; a named secret's variable holds its placeholder")
        return {**env, **placeholders(secrets)}

    async def _start(self, who: Principal, sid: Optional[str], *args, **kwargs) -> Sandbox:
        try:
            sb = await self.manager.start(*args, sandbox_id=sid, **kwargs)
        finally:
            if sid:
                self._pending.pop(sid, None)
        if not who.admin and await self.manager.store.get_tenant(who.tenant) is None:
            # The tenant was deleted while this started: it goes with the rest of its sandboxes.
            try:
                await self.manager.delete(sb.id)
            except NotFound:
                pass  # the tenant's delete found it first
            raise NotFound(f"No such tenant: {who.tenant}")
        return sb

    async def fork(self, sandbox_id: str, checkpoint: Optional[str] = None, who: Principal = ADMIN) -> Sandbox:
        """A second running copy: from one of its checkpoints, or from now."""
        source = self.get(sandbox_id, who)
        if checkpoint is not None and self.checkpoint_get(checkpoint, who).sandbox != sandbox_id:
            raise NotFound(f"No such checkpoint: {checkpoint}")  # forking through another's id is a mistake
        r = source.record
        sid = await self._admit(who, r.limits.memory_mb)  # before a checkpoint is taken for it
        try:
            spec = self.manager.specs.get(r.kernel_name)
            cp = self.checkpoint_get(checkpoint, who) if checkpoint else await self._checkpoint(source, "fork")
        except KeyError:
            self._pending.pop(sid, None)
            raise NotFound(f"No such kernel named {r.kernel_name}") from None
        except BaseException:
            self._pending.pop(sid, None)
            raise
        return await self._start(who, sid, spec.name, spec.driver, r.env, r.limits, {}, self.ttl(None), cp, r.owner,
                                 egress=r.egress, secrets=r.secrets)

    # -- tenants (the admin's) ---------------------------------------------------------
    def _admin(self, who: Principal) -> None:
        if not who.admin:
            raise Forbidden("only the admin (the gateway's token) manages tenants")

    async def tenant_model(self, rec: TenantRecord) -> dict:
        max_sandboxes, max_memory = self.tenants.quotas(rec)
        count, mem = self.usage(rec.name)
        stored = await asyncio.to_thread(self.manager.checkpoints.usage, rec.name)
        return TenantModel(name=rec.name, max_sandboxes=max_sandboxes, max_memory_mb=max_memory,
                           max_checkpoint_mb=self.tenants.checkpoint_quota(rec), created=rec.created,
                           sandboxes=count, memory_mb=mem, checkpoint_bytes=stored).model_dump()

    async def create_tenant(self, body: TenantCreate, who: Principal = ADMIN) -> dict:
        """The tenant's model and its token; the token is not kept, only its hash."""
        self._admin(who)
        left = [sb.id for sb in self.manager.list() if sb.record.owner == body.name]
        left += [c.id for c in self.manager.checkpoints.list(owner=body.name)]
        if left and await self.manager.store.get_tenant(body.name) is None:
            # A deleted tenant's checkpoint an admin's sandbox started from: the name would inherit it.
            raise Conflict(f"tenant name {body.name} is still the owner of {', '.join(left[:5])} (from a deleted "
                           "tenant of that name); delete those or pick another name", code="exists")
        rec, token = await self.tenants.create(body)
        log.info("tenant %s created", rec.name)
        return {**await self.tenant_model(rec), "token": token}

    async def list_tenants(self, who: Principal = ADMIN) -> List[dict]:
        self._admin(who)
        return [await self.tenant_model(r) for r in await self.tenants.list()]

    async def get_tenant(self, name: str, who: Principal = ADMIN) -> dict:
        self._admin(who)
        return await self.tenant_model(await self.tenants.get(name))

    async def delete_tenant(self, name: str, who: Principal = ADMIN) -> dict:
        """The tenant, its token, and every sandbox it has (with their
        checkpoints, unless an admin's sandbox started from one)."""
        self._admin(who)
        await self.tenants.delete(name)  # its token fails from now on
        ids = [sb.id for sb in self.manager.list() if sb.record.owner == name]
        results = await asyncio.gather(*(self.manager.delete(i) for i in ids), return_exceptions=True)
        for i, r in zip(ids, results):
            if isinstance(r, Exception) and not isinstance(r, NotFound):
                log.warning("tenant %s deleted: sandbox %s: %s", name, i, r)
        log.info("tenant %s deleted with %d sandboxes", name, len(ids))
        return {"name": name, "sandboxes_deleted": ids}

    # -- lifecycle -------------------------------------------------------------------
    async def delete(self, sandbox_id: str, who: Principal = ADMIN) -> None:
        self.get(sandbox_id, who)
        await self.manager.delete(sandbox_id)

    async def set_egress(self, sandbox_id: str, policy: EgressPolicy, who: Principal = ADMIN) -> Sandbox:
        sb = self.get(sandbox_id, who)
        if self.manager.egress is None:
            raise Unavailable("this gateway has no egress proxy: sandboxes here have no network")
        await sb.change_egress(policy)
        log.info("sandbox %s: egress policy now allow=%s deny=%s", sb.id, policy.allow, policy.deny)
        return sb

    async def set_timeout(self, sandbox_id: str, seconds: float, who: Principal = ADMIN) -> Sandbox:
        """Delete it ``seconds`` from now (the culler's ttl), whatever it was; within the ttl ceiling."""
        sb = self.get(sandbox_id, who)
        if not seconds > 0:
            raise BadRequest("timeout must be a positive number of seconds")
        sb.record.expires = time.time() + self.ttl(min(float(seconds), MAX_TTL))
        await sb.save()
        return sb

    async def checkpoint(self, sandbox_id: str, name: str = "", who: Principal = ADMIN) -> Checkpoint:
        return await self._checkpoint(self.get(sandbox_id, who), name)

    async def _checkpoint(self, sb: Sandbox, name: str) -> Checkpoint:
        """A checkpoint of ``sb`` within its owner's storage quota: refused (413, naming it) before
        anything is written when the tenant's checkpoints already fill it, and before the files are
        stored when they would pass it. The admin's have none."""
        owner = sb.record.owner
        rec = await self.manager.store.get_tenant(owner) if owner else None
        limit = self.tenants.checkpoint_quota(rec) if rec is not None else 0
        if not limit:
            return await sb.checkpoint(name)
        lock = self._storing.setdefault(owner, asyncio.Lock())
        async with lock:
            used = await asyncio.to_thread(self.manager.checkpoints.usage, owner)
            quota = StoreQuota(owner, limit << 20, used, "SANDGATE_TENANT_MAX_CHECKPOINT_MB")
            if quota.left <= 0:
                raise QuotaExceeded(f"no checkpoint of sandbox {sb.id} (it runs on): {quota.refuse()}")
            return await sb.checkpoint(name, quota=quota)

    async def delete_checkpoint(self, sandbox_id: str, cid: str, who: Principal = ADMIN) -> None:
        """Delete one of the sandbox's checkpoints; 409 naming what still needs it (a fork from it,
        a sandbox that resumes from it, the sandbox's newest, a newer checkpoint layered on it)."""
        self.get(sandbox_id, who)
        if self.checkpoint_get(cid, who).sandbox != sandbox_id:
            raise NotFound(f"No such checkpoint: {cid}")
        await self.manager.delete_checkpoint(cid)

    async def pause(self, sandbox_id: str, mode: str = "disk", who: Principal = ADMIN) -> Sandbox:
        sb = self.get(sandbox_id, who)
        await sb.pause(mode)
        return sb

    async def resume(self, sandbox_id: str, who: Principal = ADMIN) -> Sandbox:
        sb = self.get(sandbox_id, who)
        await sb.resume()
        return sb

    async def restart(self, sandbox_id: str, who: Principal = ADMIN) -> Sandbox:
        sb = self.get(sandbox_id, who)
        await sb.restart()
        return sb

    async def interrupt(self, sandbox_id: str, who: Principal = ADMIN) -> None:
        await self.get(sandbox_id, who).interrupt()

    async def execute(self, sandbox_id: str, code: str, timeout: float,
                      on_output: Optional[OutputCallback] = None, who: Principal = ADMIN,
                      execution_id: Optional[str] = None, on_begin: Optional[BeginCallback] = None) -> dict:
        return await self.get(sandbox_id, who).execute(code, timeout, on_output, execution_id, on_begin)

    # -- files --------------------------------------------------------------------------
    async def _agent(self, sandbox_id: str, op: str, args: dict, payload: bytes = b"", who: Principal = ADMIN,
                     raw: bool = False):
        sb = self.get(sandbox_id, who)
        async with sb.lock:  # no pause or checkpoint takes the link away mid-request
            await sb._run_again()
            sb.last_activity = utcnow()  # file work is use: not idle
            try:
                return await sb.link.request(op, args, payload)
            except AgentError as e:
                if raw:
                    raise
                raise file_error(e, args.get("path", ""), op) from None

    async def list_files(self, sandbox_id: str, path: str, who: Principal = ADMIN) -> dict:
        return (await self._agent(sandbox_id, "file_list", {"path": path}, who=who))[0]

    async def read_file(self, sandbox_id: str, path: str, who: Principal = ADMIN) -> bytes:
        return b"".join([data async for _, data in self.read_file_chunks(sandbox_id, path, who)])

    async def read_file_chunks(self, sandbox_id: str, path: str, who: Principal = ADMIN,
                               chunk: int = READ_CHUNK) -> AsyncIterator[Tuple[int, bytes]]:
        """The file a chunk at a time, as (its size, the chunk): a front end writes each to its client
        and waits for it to be flushed before asking for the next, so a client that does not read
        holds one chunk in the gateway, not the file. The sandbox's lock is taken per chunk (a pause
        or checkpoint may come between two); a file that changes between chunks is a Conflict."""
        offset, total, version = 0, None, None
        while True:
            info, data = await self._agent(sandbox_id, "file_read", {"path": path, "offset": offset, "length": chunk},
                                           who=who)
            if "total" not in info:  # an agent from before ranges (restored from an old checkpoint): the whole file
                yield len(data), data
                return
            if total is None:
                total, version = info["total"], info["file"]
            elif info["file"] != version:
                raise Conflict(f"{path} changed while it was being read; read it again")
            offset += len(data)
            yield total, data
            if offset >= total or not data:
                if offset != total:
                    raise Conflict(f"{path} changed while it was being read; read it again")
                return

    async def write_file(self, sandbox_id: str, path: str, data: bytes, who: Principal = ADMIN) -> dict:
        self.get(sandbox_id, who)  # 404 before 400: nothing said about a sandbox it cannot see
        if not path or path.endswith("/"):
            raise BadRequest("a file path is required")
        return {"path": path, **(await self._agent(sandbox_id, "file_write", {"path": path}, data, who=who))[0]}

    def upload(self, sandbox_id: str, path: str, who: Principal = ADMIN) -> "Upload":
        """A file written as its bytes arrive (Upload)."""
        self.get(sandbox_id, who)
        if not path or path.endswith("/"):
            raise BadRequest("a file path is required")
        return Upload(self, sandbox_id, path, who)

    async def delete_file(self, sandbox_id: str, path: str, who: Principal = ADMIN) -> None:
        await self._agent(sandbox_id, "file_delete", {"path": path}, who=who)


class Upload:
    """A file written a chunk at a time, each chunk sent to the agent (``file_write_part``) as
    it arrives and awaited before the next is taken: the gateway holds one chunk of an upload,
    not the file. The agent writes a temporary file that the last chunk renames over the path,
    so the file appears whole or not at all; ``abort`` removes it. An agent from before
    chunks (a sandbox restored from an old checkpoint) gets the whole file in one write."""

    def __init__(self, service: "SandboxService", sandbox_id: str, path: str, who: Principal):
        self.service, self.sandbox_id, self.path, self.who = service, sandbox_id, path, who
        self.id = uuid.uuid4().hex[:16]
        self.offset = 0
        self.whole: Optional[bytearray] = None  # the old agent's way: gathered here
        self.done = False

    async def write(self, data: bytes, last: bool = False) -> Optional[dict]:
        """The next chunk; with ``last``, the end: the file's answer (as write_file's)."""
        if self.whole is not None:
            self.whole += data
            if last:
                self.done = True
                return await self.service.write_file(self.sandbox_id, self.path, bytes(self.whole), self.who)
            return None
        args = {"path": self.path, "upload": self.id, "offset": self.offset, "last": last}
        try:
            info, _ = await self.service._agent(self.sandbox_id, "file_write_part", args, data, who=self.who,
                                                raw=True)
        except AgentError as e:
            if self.offset == 0 and "unknown op" in str(e):
                self.whole = bytearray()
                return await self.write(data, last)
            self.done = True  # the agent removed its temporary file with the failed chunk
            raise file_error(e, self.path) from None
        self.offset = info["size"]
        if last:
            self.done = True
            return {"path": self.path, "size": self.offset}
        return None

    async def abort(self) -> None:
        """The client went, or the body was refused: nothing of it is left in the sandbox."""
        if self.done or self.whole is not None or self.offset == 0:
            self.done = True
            return
        self.done = True
        try:
            await self.service._agent(self.sandbox_id, "file_write_part",
                                      {"path": self.path, "upload": self.id, "abort": True}, who=self.who)
        except SandgateError as e:
            log.warning("sandbox %s: upload of %s not cleaned up: %s", self.sandbox_id, self.path, e)


ERRNO = re.compile(r"\[Errno (\d+)\] ([^:]+)")
NAME_MAX = 255  # bytes in one name: Linux's file systems' limit (ext4, gVisor's tmpfs)
# The agent's OSErrors by errno ("[Errno N] text"; the agent of any version says it so): what in the
# request, or in the workspace's state, the caller has to change. None of them is a 500.
BY_ERRNO = {
    errno.ENAMETOOLONG: BadRequest, errno.EINVAL: BadRequest, errno.ELOOP: Forbidden, errno.EROFS: Forbidden,
    errno.ENXIO: Forbidden, errno.ENODEV: Forbidden, errno.ENOTEMPTY: Conflict, errno.EEXIST: Conflict,
    errno.EBUSY: Conflict, errno.ENOSPC: LimitReached, errno.EDQUOT: LimitReached, errno.EFBIG: LimitReached,
    errno.EMLINK: LimitReached, errno.EMFILE: LimitReached, errno.ENFILE: LimitReached,
}


def file_error(e: AgentError, path: str, op: str = "") -> SandgateError:
    """The agent's error kinds, as the taxonomy's."""
    text = str(e).split(": ", 1)[-1]
    if e.code == "FileNotFoundError":
        return NotFound(f"No such file: {path}")
    if e.code == "PermissionError":
        return Forbidden(text)
    if e.code in ("IsADirectoryError", "NotADirectoryError"):
        return BadRequest(text, code=e.code)
    if e.code == "ValueError":  # a path the agent cannot use (a NUL byte, say): the caller's, not a 500
        return BadRequest(f"bad path {path!r}: {text}")
    if e.code == "AnswerTooLarge":  # past the agent protocol's frame (protocol.md)
        if op == "file_list":
            return LimitReached(f"the listing of {path or 'the workspace'!r} is over the agent protocol's 1 MiB for "
                                "one listing (about 10,000 entries): list its subdirectories instead")
        return LimitReached(f"{path!r} is over the agent protocol's 256 MiB for one file: read it in a cell")
    if e.code == "FrameTooLarge":  # e.g. a file past what one agent frame carries
        return TooLarge(f"{path}: {text}")
    if e.code == "stream":
        return Unavailable(f"the sandbox's agent is unreachable: {e}")
    if "No space left" in text:
        return LimitReached(f"the sandbox's workspace is full: {text}")
    found = ERRNO.search(str(e))
    if found and int(found.group(1)) in BY_ERRNO:
        number = int(found.group(1))
        name = errno.errorcode.get(number, str(number))
        if number == errno.ENAMETOOLONG:
            return BadRequest(f"a name in {path[:100]!r}{'...' if len(path) > 100 else ''} is longer than {NAME_MAX} "
                              f"bytes, the file system's limit ({name})", code="bad_request")
        return BY_ERRNO[number](f"{path!r}: {found.group(2).strip()} ({name})")
    return SandgateError(f"{e.code}: {text}")


__all__ = ["SandboxService", "StartRequest", "LimitsRequest", "SandboxModel", "sandbox_model", "Conflict", "Principal",
           "ADMIN", "TenantCreate"]
