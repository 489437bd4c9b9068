"""The service layer: what every front end calls (the Jupyter REST and
websocket API, the sandbox API, and the E2B API, MCP server and SDK to come).

No tornado here. Requests arrive as validated pydantic models; answers leave
as plain dicts of the API models below; failures are core.errors classes,
which each front end maps once (api/base.py for HTTP).
"""

from __future__ import annotations

import logging
import re
from typing import Awaitable, Callable, Dict, List, Optional

from pydantic import BaseModel, ConfigDict, Field

from ..agent_link import AgentError
from ..checkpoints import Checkpoint
from ..config import Settings
from ..drivers.base import Limits
from .errors import BadRequest, CeilingExceeded, Conflict, Forbidden, LimitReached, NotFound, SandgateError, Unavailable
from .manager import SandboxManager
from .messages import utcnow
from .sandbox import Sandbox
from .states import State

log = logging.getLogger("sandgate.service")


# -- request models (the edge validates; the core trusts) ---------------------
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
MAX_TTL = 10 * 365 * 86400  # beyond any ceiling an operator sets; keeps expiry a real date
class LimitsRequest(BaseModel):
    """Any subset; the rest are the gateway's defaults."""

    model_config = ConfigDict(extra="forbid")
    memory_mb: Optional[int] = Field(None, ge=64)
    cpus: Optional[float] = Field(None, gt=0, allow_inf_nan=False)
    pids: Optional[int] = Field(None, ge=16)
    disk_mb: Optional[int] = Field(None, ge=16)


class SandboxCreate(BaseModel):
    """The body of POST /api/sandboxes (and what other front ends ask for)."""

    model_config = ConfigDict(extra="forbid")
    driver: Optional[str] = Field(None, description="sandbox driver; the server default when omitted")
    env: Dict[str, str] = Field({}, description="KERNEL_* (and allow-listed) variables for the sandbox")
    labels: Dict[str, str] = {}
    limits: Optional[LimitsRequest] = Field(None, description="any subset; above an operator ceiling is a 400")
    ttl: Optional[float] = Field(None, gt=0, le=MAX_TTL, allow_inf_nan=False,
                                 description="seconds until the sandbox is deleted")
    checkpoint: Optional[str] = Field(None, description="start from this checkpoint instead of cold")


class StartRequest(SandboxCreate):
    """What the service starts: a create body, plus what the front end knows (kernelspec, owner)."""

    kernel_name: Optional[str] = Field(None, description="kernelspec; the default when omitted")
    owner: str = ""


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
    labels: Dict[str, str]
    created: str
    last_activity: str
    expires: Optional[str] = None
    resume_from: Optional[str] = None  # set when its running state was lost: it resumes from this checkpoint
    reason: Optional[str] = None  # why it is dead, or what a recovery cost


def sandbox_model(sb: Sandbox) -> dict:
    r, m = sb.record, sb.model()
    parent = {"sandbox": r.parent, "checkpoint": r.origin} if r.origin else None
    return SandboxModel(id=r.id, state=r.state, pause_mode=r.pause_mode, execution_state=sb.execution_state,
                        driver=r.driver, kernel_id=r.id, runtime_id=sb.runtime.id if sb.runtime else None,
                        parent=parent, head=r.head, limits=r.limits, labels=r.labels, created=m["created"],
                        last_activity=m["last_activity"], expires=m.get("expires"), resume_from=r.resume_from,
                        reason=r.reason).model_dump(mode="json")


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else str(v)


OutputCallback = Callable[[dict], Awaitable[None]]


class SandboxService:
    def __init__(self, manager: SandboxManager):
        self.manager = manager
        self.settings: Settings = manager.settings

    # -- reading -------------------------------------------------------------------
    def get(self, sandbox_id: str) -> Sandbox:
        return self.manager.get(sandbox_id)

    def list(self) -> List[Sandbox]:
        return self.manager.list()

    def kernelspecs(self) -> dict:
        return self.manager.specs.model()

    def kernelspec(self, name: str) -> dict:
        try:
            return self.manager.specs.get(name).model()
        except KeyError:
            raise NotFound(f"Kernel spec {name} not found") from None

    def checkpoint_get(self, cid: str) -> Checkpoint:
        try:
            return self.manager.checkpoints.get(cid)
        except KeyError:
            raise NotFound(f"No such checkpoint: {cid}") from None

    def checkpoints(self, sandbox_id: str) -> List[dict]:
        self.get(sandbox_id)
        return [c.summary() for c in self.manager.checkpoints.list(sandbox=sandbox_id)]

    def tree(self) -> dict:
        nodes = [{"kind": "checkpoint", **c.summary()} for c in self.manager.checkpoints.list()]
        nodes += [{"kind": "sandbox", "id": sb.id, "parent": sb.record.origin, "state": sb.state.value}
                  for sb in self.list()]
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

    async def start(self, req: StartRequest) -> Sandbox:
        specs = self.manager.specs
        cp = self.checkpoint_get(req.checkpoint) if req.checkpoint else None
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
        if source and not req.limits:
            limits = source.record.limits  # a fork keeps its parent's limits...
        if source and not req.env:
            env = source.record.env  # ...and environment
        return await self.manager.start(spec.name, spec.driver, env, limits, labels=req.labels, ttl=self.ttl(req.ttl),
                                        checkpoint=cp, owner=req.owner)

    async def fork(self, sandbox_id: str, checkpoint: Optional[str] = None) -> Sandbox:
        """A second running copy: from one of its checkpoints, or from now."""
        source = self.get(sandbox_id)
        if checkpoint is None:
            checkpoint = (await source.checkpoint("fork")).id
        elif self.checkpoint_get(checkpoint).sandbox != sandbox_id:
            raise NotFound(f"No such checkpoint: {checkpoint}")  # forking through another's id is a mistake
        return await self.start(StartRequest(kernel_name=source.record.kernel_name, checkpoint=checkpoint,
                                             owner=source.record.owner))

    # -- lifecycle -------------------------------------------------------------------
    async def delete(self, sandbox_id: str) -> None:
        await self.manager.delete(sandbox_id)

    async def checkpoint(self, sandbox_id: str, name: str = "") -> Checkpoint:
        return await self.get(sandbox_id).checkpoint(name)

    async def pause(self, sandbox_id: str, mode: str = "disk") -> Sandbox:
        sb = self.get(sandbox_id)
        await sb.pause(mode)
        return sb

    async def resume(self, sandbox_id: str) -> Sandbox:
        sb = self.get(sandbox_id)
        await sb.resume()
        return sb

    async def restart(self, sandbox_id: str) -> Sandbox:
        sb = self.get(sandbox_id)
        await sb.restart()
        return sb

    async def interrupt(self, sandbox_id: str) -> None:
        await self.get(sandbox_id).interrupt()

    async def execute(self, sandbox_id: str, code: str, timeout: float,
                      on_output: Optional[OutputCallback] = None) -> dict:
        return await self.get(sandbox_id).execute(code, timeout, on_output)

    # -- files --------------------------------------------------------------------------
    async def _agent(self, sandbox_id: str, op: str, args: dict, payload: bytes = b""):
        sb = self.get(sandbox_id)
        async with sb.lock:  # no pause or checkpoint takes the link away mid-request
            await sb._run_again()
            sb.last_activity = utcnow()  # file work is use: not idle
            try:
                return await sb.link.request(op, args, payload)
            except AgentError as e:
                raise file_error(e, args.get("path", "")) from None

    async def list_files(self, sandbox_id: str, path: str) -> dict:
        return (await self._agent(sandbox_id, "file_list", {"path": path}))[0]

    async def read_file(self, sandbox_id: str, path: str) -> bytes:
        return (await self._agent(sandbox_id, "file_read", {"path": path}))[1]

    async def write_file(self, sandbox_id: str, path: str, data: bytes) -> dict:
        if not path or path.endswith("/"):
            raise BadRequest("a file path is required")
        return {"path": path, **(await self._agent(sandbox_id, "file_write", {"path": path}, data))[0]}

    async def delete_file(self, sandbox_id: str, path: str) -> None:
        await self._agent(sandbox_id, "file_delete", {"path": path})


def file_error(e: AgentError, path: str) -> SandgateError:
    """The agent's error kinds, as the taxonomy's."""
    text = str(e).split(": ", 1)[-1]
    if e.code == "FileNotFoundError":
        return NotFound(f"No such file: {path}")
    if e.code == "PermissionError":
        return Forbidden(text)
    if e.code in ("IsADirectoryError", "NotADirectoryError"):
        return BadRequest(text, code=e.code)
    if e.code == "stream":
        return Unavailable(f"the sandbox's agent is unreachable: {e}")
    if "No space left" in text:
        return LimitReached(f"the sandbox's workspace is full: {text}")
    return SandgateError(f"{e.code}: {text}")


__all__ = ["SandboxService", "StartRequest", "LimitsRequest", "SandboxModel", "sandbox_model", "Conflict"]
