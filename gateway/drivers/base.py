"""The driver interface: the spine every sandbox backend plugs into.

A driver knows how to start one sandbox running the guest agent, hand back
the agent's byte stream, and destroy it. It knows nothing of Jupyter, HTTP,
tenants or routing. A new backend is one new module with one Driver subclass
registered in drivers/__init__.py.
"""

from __future__ import annotations

import abc
import asyncio
import hashlib
import logging
import os
import signal
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Dict, Iterable, List, Optional, Tuple

from pydantic import BaseModel, Field

from .console import ConsoleLog

if TYPE_CHECKING:  # config imports this package (Limits): the settings come in as arguments
    from ..config import Settings


class Limits(BaseModel):
    """What one sandbox may use. The gateway's defaults and ceilings are in
    config.Settings; a request is checked against the ceilings at the edge."""

    memory_mb: int = Field(1024, ge=64, le=1 << 20)
    cpus: float = Field(1.0, gt=0, le=256, allow_inf_nan=False)
    pids: int = Field(512, ge=16, le=1 << 20)
    disk_mb: int = Field(1024, ge=16, le=1 << 24)  # the workspace's size


class SandboxSpec(BaseModel):
    id: str
    rootfs: Path  # read-only image root
    agent_dir: Path  # holds the sandgate_agent package, mounted read-only
    workspace: Path  # host directory, the sandbox's only writable persistent storage
    state_dir: Path  # driver-private files for this sandbox
    env: Dict[str, str] = {}  # exactly what the sandbox sees, beyond the base variables
    # The sandbox's newest checkpoint image. A VM driver, whose workspace is a disk that a
    # checkpoint takes with it, starts a cold boot from that image's disk if the workspace has none.
    workspace_seed: Optional[Path] = None
    limits: Limits = Limits()


class SandboxError(Exception):
    """A sandbox could not be created or has failed; the message says why."""


class RuntimeLease:
    """The home's lease file, whose time a running gateway keeps renewing. A runtime that
    can outlive its gateway (gVisor's shim) ends once no gateway is connected to it and
    the lease is older than ``seconds``: a node whose gateway stays down, whose sandboxes
    other nodes take over, keeps no second copy of them. 0: no lease (runtimes wait)."""

    def __init__(self, home: Path, seconds: float = 0):
        self.path = home / "runtimes.lease"
        self.seconds = seconds

    def shim_args(self) -> List[str]:
        return ["--lease", str(self.path), f"{self.seconds:g}"] if self.seconds else []

    def renew(self) -> None:
        try:
            self.path.touch()
        except OSError as e:  # the runtimes' own grace (their last gateway connection) still holds
            logging.getLogger("sandgate.drivers").warning("runtime lease %s not renewed: %s", self.path, e)

    async def keep(self) -> None:
        """Renew it, a few times per lease, until cancelled."""
        if not self.seconds:
            return
        while True:
            self.renew()
            await asyncio.sleep(min(max(self.seconds / 4, 0.5), 10.0))


def require_disk_for_checkpoint(path: Path, need: int) -> None:
    """Refuse a checkpoint up front unless ``need`` bytes are free where its
    image goes: a runtime that runs out of disk midway loses the sandbox
    (runsc stops it even when writing the image fails)."""
    st = os.statvfs(path)
    free = st.f_bavail * st.f_frsize
    if free < need:
        raise SandboxError(f"not enough disk space for a checkpoint: {free >> 20} MB free in {path}, "
                           f"up to {need >> 20} MB needed")


def tag(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def socket_dir(home: Path, runtime_id: str, kind: str) -> Path:
    """Where one runtime's unix sockets and handles go: a socket path must
    stay under 108 bytes, which the gateway's home may well exceed. Named by
    the home (so reap() finds its own) and the runtime id (so a later
    gateway process finds them again: Driver.adopt)."""
    return Path(tempfile.gettempdir()) / f"sg{kind}-{tag(str(home))}-{tag(runtime_id)}"


def tail_lines(path: Path, max_bytes: int = 16 << 10) -> List[str]:
    """The last non-empty lines of a runtime's log file (its stderr: a file
    outlives the gateway process, where a pipe would break and kill it)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - max_bytes))
            return [ln.strip() for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return []


async def connect_unix(path: Path, alive: Callable[[], bool], deadline: float,
                       what: str) -> Tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Connect once the runtime listens on ``path``; gives up at once when it
    has exited (``alive``), else after ``deadline`` seconds."""
    end = time.monotonic() + deadline
    while True:
        try:
            return await asyncio.open_unix_connection(str(path), limit=1 << 20)
        except OSError:
            if not alive():
                raise SandboxError(f"{what}: the process exited before its socket opened") from None
            if time.monotonic() > end:
                raise SandboxError(f"{what}: its socket did not open within {deadline:g} s") from None
            await asyncio.sleep(0.02)


def process_has(pid: int, marker: str) -> bool:
    """Whether process ``pid`` is alive and has ``marker`` in its command line:
    a pid read from a file may since have been reused by anything."""
    try:
        return marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


class AdoptedProcess:
    """A runtime process an earlier gateway process started (it was killed),
    with the part of asyncio's Process that sandboxes use. It is not this
    process's child, so its exit is seen through a pidfd, and its exit status
    only if ``status`` can tell it (else ``UNKNOWN``)."""

    UNKNOWN = 255

    def __init__(self, pid: int, marker: str, status: Callable[[], Optional[int]] = lambda: None):
        self.pid = pid
        self.returncode: Optional[int] = None
        self._status = status
        self._loop = asyncio.get_running_loop()
        self._exited = self._loop.create_future()
        try:
            self._fd = os.pidfd_open(pid)
        except OSError as e:
            raise SandboxError(f"process {pid} is gone: {e}") from None
        if not process_has(pid, marker):  # checked after the pidfd pins the process
            os.close(self._fd)
            raise SandboxError(f"process {pid} is gone")
        self._loop.add_reader(self._fd, self._on_exit)

    def _on_exit(self) -> None:
        self._loop.remove_reader(self._fd)
        os.close(self._fd)
        self._fd = -1
        code = self._status()
        self.returncode = self.UNKNOWN if code is None else code
        self._exited.set_result(self.returncode)

    async def wait(self) -> int:
        return await asyncio.shield(self._exited)

    def kill(self) -> None:
        if self._fd >= 0:
            signal.pidfd_send_signal(self._fd, signal.SIGKILL)


class Sandbox(abc.ABC):
    """One running sandbox. ``reader``/``writer`` are the agent's stream."""

    def __init__(self, spec: SandboxSpec):
        self.spec = spec
        self.reader: Optional[asyncio.StreamReader] = None
        self.writer: Optional[asyncio.StreamWriter] = None

    @property
    def id(self) -> str:
        return self.spec.id

    @property
    @abc.abstractmethod
    def running(self) -> bool:
        """Whether the sandbox's processes are still up."""

    @abc.abstractmethod
    async def wait(self) -> int:
        """Wait until the sandbox has stopped; returns its exit status."""

    @abc.abstractmethod
    def failure(self) -> str:
        """Why the sandbox stopped, for people: exit status and last log lines."""

    @abc.abstractmethod
    async def destroy(self) -> None:
        """Stop the sandbox and remove everything it left on the host."""


class ProcessSandbox(Sandbox):
    """A sandbox that lives exactly as long as one host process (runsc, qemu)."""

    proc = None  # an asyncio.subprocess.Process, or an AdoptedProcess
    console: Optional[ConsoleLog] = None  # a VM's serial console, read from the process's stdout

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def wait(self) -> int:
        assert self.proc, "sandbox not started"
        code = await self.proc.wait()
        if self.console:
            await self.console.drained()  # so that failure() sees the guest's last words
        return code


class Driver(abc.ABC):
    name: str = ""
    can_checkpoint: bool = True  # whether checkpoint/restore (and so warm start) are implemented
    # The workspace is a disk the checkpoint takes with it (VMs): the guest flushes
    # its writes first, so that disk is whole on its own (a restart may start from it).
    sync_before_checkpoint: bool = False
    # Whether create() hands SandboxSpec.env to the agent itself (gVisor: the OCI
    # process env). If not, the core sends it in a `setup` request after boot.
    env_at_boot: bool = True
    # Whether the workspace directory is shared into the sandbox as files (gVisor),
    # so the core gives it a size-limited disk of its own; VMs keep a disk image in it.
    shares_workspace: bool = True
    # Files of a checkpoint image that the checkpoint store keeps as content-addressed chunks
    # (state_chunks.py), so that a checkpoint after a small change stores little. Only files
    # nothing refers to by path (a qcow2 overlay is another disk's backing file: kept whole).
    state_images: Tuple[str, ...] = ()
    # Whether a checkpoint's files are layered on its parent's (a qcow2 overlay whose backing file
    # is the older checkpoint's disk), and a sandbox restored from one on that checkpoint's: then
    # a checkpoint cannot be deleted while a newer one or such a sandbox needs it.
    layered_checkpoints: bool = False
    lease = RuntimeLease(Path("/"))  # the gateway's (app.make_service); this one is none

    @classmethod
    @abc.abstractmethod
    def probe(cls, settings: "Settings") -> Tuple[bool, str]:
        """Whether this host can run the driver (as settings configure it), and a one-line explanation."""

    @abc.abstractmethod
    async def create(self, spec: SandboxSpec) -> Sandbox:
        """Start a sandbox whose agent is ready to read frames."""

    async def reap(self, keep: Iterable[str] = ()) -> int:
        """Remove sandboxes a previous gateway process left behind (it was
        killed), except the runtimes in ``keep`` (adopted); returns how many.
        Run once at start-up, after adopt()."""
        return 0

    async def adopt(self, runtime: str) -> Sandbox:
        """Take over the sandbox ``runtime`` (its Sandbox.id) that an earlier
        gateway process started and left running (it was killed), with the
        spec it was started with. Returns it with a fresh stream to its agent,
        or raises SandboxError if it is gone or this driver cannot adopt."""
        raise SandboxError(f"the {self.name} driver cannot adopt a running sandbox")

    async def checkpoint(self, sandbox: Sandbox, image_dir: Path) -> None:
        """Save the running state of ``sandbox`` into ``image_dir`` and stop it;
        if it fails before the sandbox stops, the sandbox runs on untouched.
        Files in the workspace directory are not part of the image: the caller
        snapshots them while the sandbox is stopped, so memory and files are
        of the same instant. A driver whose workspace is a disk image (VMs)
        moves that disk into ``image_dir`` instead, leaving no file behind."""
        raise SandboxError(f"the {self.name} driver cannot checkpoint")

    # Whether checkpoint_in_place() works here: a checkpoint that leaves the sandbox where
    # it was, so a checkpoint or fork costs the sandbox no restore.
    checkpoints_in_place: bool = False

    async def checkpoint_in_place(self, sandbox: Sandbox, image_dir: Path) -> None:
        """Like checkpoint(), but the sandbox is left paused where it was (memory and
        processes kept), not stopped: the caller snapshots the workspace, then calls
        ``unpause``. If it fails, the sandbox runs on untouched."""
        raise SandboxError(f"the {self.name} driver cannot checkpoint in place")

    async def unpause(self, sandbox: Sandbox) -> None:
        """End the pause checkpoint_in_place() left the sandbox in."""
        raise SandboxError(f"the {self.name} driver cannot checkpoint in place")

    async def freeze(self, sandbox: Sandbox) -> None:
        """Stop the sandbox where it is, memory and processes kept: a pause
        that ``thaw`` ends in milliseconds (a checkpoint pause frees memory,
        this one frees only the CPU)."""
        raise SandboxError(f"the {self.name} driver cannot pause in memory")

    async def thaw(self, sandbox: Sandbox) -> None:
        raise SandboxError(f"the {self.name} driver cannot pause in memory")

    async def restore(self, spec: SandboxSpec, image_dir: Path, consume: bool = False) -> Sandbox:
        """Start a new sandbox running from a checkpoint, any number of times;
        ``image_dir`` stays unchanged. With ``consume`` (resuming a pause) the
        caller removes ``image_dir`` afterwards, so files may be moved out of
        it; if the restore fails, ``image_dir`` must be left whole."""
        raise SandboxError(f"the {self.name} driver cannot restore")

    async def settle(self, runtime: str) -> None:
        """Before adopting ``runtime`` after a gateway was killed: wait (bounded) for what
        that gateway had started on it and that outlives it (a checkpoint) to end."""

    async def undo_pause(self, sandbox: Sandbox) -> None:
        """An adopted runtime caught mid-operation: end whatever pause (a freeze, a
        checkpoint in place) that operation may have left it in; nothing if none."""
        try:
            await self.thaw(sandbox)
        except SandboxError:
            pass  # not frozen, or no freezing here
        if self.checkpoints_in_place:
            try:
                await self.unpause(sandbox)
            except SandboxError:
                pass  # not paused

    def image_whole(self, image_dir: Path) -> bool:
        """Whether ``image_dir`` holds a running-state image this driver finished writing."""
        try:
            return any(image_dir.iterdir())
        except OSError:
            return False

    def after_restore(self, sandbox: Sandbox) -> None:
        """A restored sandbox's agent has answered: housekeeping that must not
        slow the restore itself starts here (gVisor hands its heap back)."""
