"""QEMU microVM sandboxes: one small VM per sandbox, with its own kernel.

``qemu-system-x86_64 -M microvm`` boots the Debian cloud kernel with the
initramfs from images/vm.py. Disks are qcow2 overlays, so each VM costs only
what it writes: the root on the shared read-only base, the workspace on a
shared empty ext4 (the overlay lives in the sandbox's workspace directory, so
a restart keeps the files), and the agent bundle read-only. The agent's
stream is a virtio-serial port backed by a unix socket, or AF_VSOCK where the
host has /dev/vhost-vsock; the VM has no network device at all.

A checkpoint is QMP ``stop`` + ``migrate`` to a file, and the VM's overlays
move into the checkpoint. A restore starts qemu with ``-incoming`` from that
file on new overlays whose backing files are the checkpoint's, so one
checkpoint restores any number of times (fork) and stays unchanged.

Acceleration: KVM when a trial boot under it reaches the guest's userspace
within a deadline, else TCG (see ``accel``); SANDGATE_QEMU_ACCEL forces one.

Confinement (a guest that owns its kernel may find a bug in qemu's devices):
qemu runs under its seccomp filter (``-sandbox``: no fork/exec, no obsolete
or resource-control calls), as a uid of its own that no account has
(``-runas uid:gid`` once its files are open), in a cgroup of its own with the
sandbox's limits. It never opens a file by name after that: the migration
stream comes and goes as file descriptors the gateway opened.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import errno
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, List, Optional, Tuple

from ..workspace import unused_id
from ..confine import release
from .base import (AdoptedProcess, Driver, Limits, ProcessSandbox, Sandbox, SandboxError, SandboxSpec, connect_unix,
                   require_disk_for_checkpoint, socket_dir, tag, tail_lines)
from .console import ConsoleLog

if TYPE_CHECKING:  # config imports this package (Limits): the settings come in as arguments
    from ..config import Settings

log = logging.getLogger("sandgate.qemu")

AGENT_VSOCK_PORT = 1024
PROBE_TIMEOUT = 10.0  # a KVM guest reaches userspace in well under a second
BOOT_TIMEOUT = 120.0  # until a vsock agent listens: guest boot plus Python (the serial socket is qemu's own)
QMP_TIMEOUT = 30.0
QMP_OPEN_TIMEOUT = 60.0  # qemu's start on a loaded host under TCG; a qemu that exits ends the wait at once
EXIT_GRACE = 5.0  # how long a qemu that reported a fatal error gets to exit and say why on stderr

# qemu's seccomp filter. elevateprivileges stays allowed because qemu 7.2's -runas
# calls setgid/setuid after the filter is loaded (with "deny" it dies of SIGSYS at
# start); after that drop it has no capabilities and all its ids are equal, so a
# set*id call can change nothing.
SECCOMP = "on,obsolete=deny,elevateprivileges=allow,spawn=deny,resourcecontrol=deny"
# Each VM runs as its own uid (= gid) from this range, which no account has: in
# systemd's unused 0x70000000-0x7FFDFFFF band, above its container ranges.
UID_BASE, UID_SPAN = 1_900_000_000, 1 << 16
CGROUP_ROOT = Path("/sys/fs/cgroup")
CGROUP_PARENT = "sandgate-qemu"
# A VM's cgroup holds its guest's RAM plus qemu itself: device emulation, and under
# TCG the translated code, bounded by tb-size. What the host charges for the VM
# beyond its guest memory, in MiB (measured: docs/security.md, "qemu confinement").
TCG_TB_MB = 256
OVERHEAD_MB = {"kvm": 256, "tcg": 256 + TCG_TB_MB}
VM_PIDS = 256  # qemu's own threads (vCPUs, I/O workers); the guest's processes live in its kernel


def qemu_path() -> Optional[str]:
    return shutil.which("qemu-system-x86_64")


def host_tsc_khz() -> Optional[int]:
    """The host's TSC rate, which is the guest's under TCG. Without it the guest
    calibrates its TSC against the emulated PIT, which fails now and then under
    TCG and leaves the kernel hung at boot (about one boot in ten here)."""
    try:
        info = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
    except OSError:
        return None
    fields = {k.strip(): v for k, v in (line.split(":", 1) for line in info.splitlines() if ":" in line)}
    try:
        return int(float(fields["cpu MHz"]) * 1000) if "constant_tsc" in fields.get("flags", "").split() else None
    except (KeyError, ValueError):
        return None


def vhost_vsock() -> bool:
    return os.path.exists("/dev/vhost-vsock") and hasattr(socket, "AF_VSOCK")


def _probe_boot(image: Path, timeout: float) -> Tuple[bool, str]:
    """Boot the guest kernel under KVM with ``sandgate.probe=1``: its init
    prints a marker and powers off. Only a marker within the deadline counts."""
    try:
        fd = os.open("/dev/kvm", os.O_RDWR)
        os.close(fd)
    except OSError as e:
        return False, f"/dev/kvm unusable: {e.strerror}"
    with tempfile.TemporaryDirectory() as tmp:
        console = Path(tmp) / "console"
        try:
            p = subprocess.run([qemu_path() or "qemu-system-x86_64", "-M", "microvm", "-accel", "kvm", "-m", "256",
                                "-nodefaults", "-no-user-config", "-display", "none", "-serial", f"file:{console}",
                                "-kernel", str(image / "vmlinuz"), "-initrd", str(image / "initrd.gz"),
                                "-append", "console=ttyS0 quiet panic=-1 sandgate.probe=1", "-no-reboot"],
                               stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return False, f"a guest under KVM did not reach userspace within {timeout:g} s (nested KVM that hangs guests)"
        booted = console.exists() and "sandgate-probe-ok" in console.read_text(errors="replace")
        if booted:
            return True, "a trial boot under KVM reached userspace"
        return False, "a trial boot under KVM failed: " + (p.stderr.decode(errors="replace").strip()[-200:] or
                                                          f"qemu exited with status {p.returncode}")


def accel(home: Path, image: Path, forced: Optional[str] = None) -> Tuple[str, str]:
    """``kvm`` or ``tcg`` and why: forced (the qemu_accel setting), or a trial boot's answer,
    remembered per guest image, host kernel and qemu binary, in home/images/qemu-accel.json."""
    if forced:
        return forced, "set by SANDGATE_QEMU_ACCEL"
    if not os.path.exists("/dev/kvm"):
        return "tcg", "no /dev/kvm"
    qemu = qemu_path() or ""
    key = f"{image.name}:{os.uname().release}:{qemu}:{os.stat(qemu).st_mtime if qemu else 0}"
    cache = home / "images" / "qemu-accel.json"
    cache.parent.mkdir(parents=True, exist_ok=True)
    try:
        known = json.loads(cache.read_text())
        if known.get("key") == key:
            return known["accel"], known["why"] + " (remembered)"
    except (OSError, ValueError, KeyError):
        pass
    ok, why = _probe_boot(image, PROBE_TIMEOUT)
    answer = {"key": key, "accel": "kvm" if ok else "tcg", "why": why}
    tmp = cache.with_suffix(f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(answer))
    os.replace(tmp, cache)
    return answer["accel"], why


def vm_shape(limits: Limits) -> Tuple[int, int]:
    """The memory (MiB) and vCPUs a VM gets for these limits. A migration
    restores only into a machine of the same shape."""
    return limits.memory_mb, max(1, int(limits.cpus))


class VMCgroup:
    """The cgroup of one VM, with its limits: memory (guest RAM plus qemu's
    overhead), CPU time (the sandbox's ``cpus``) and qemu's threads. On
    cgroup v2 one directory /sys/fs/cgroup/sandgate-qemu/<name>, on v1 one
    per controller (memory, cpu, pids)."""

    def __init__(self, name: str):
        self.v2 = (CGROUP_ROOT / "cgroup.controllers").exists()
        controllers = [""] if self.v2 else ["memory", "cpu", "pids"]
        self.dirs = [CGROUP_ROOT / c / CGROUP_PARENT / name for c in controllers]
        self.memory_dir = self.dirs[0]

    def create(self, memory_mb: int, cpus: float, pids: int) -> List[Path]:
        """Make the cgroup; returns the cgroup.procs files a process joins it by."""
        period = 100_000
        quota = max(1000, int(cpus * period))
        try:
            if self.v2:
                parent = CGROUP_ROOT / CGROUP_PARENT
                parent.mkdir(exist_ok=True)
                for d in (CGROUP_ROOT, parent):  # the controllers, delegated down to the VMs' cgroups
                    (d / "cgroup.subtree_control").write_text("+memory +cpu +pids")
                d = self.dirs[0]
                d.mkdir(exist_ok=True)  # sandbox ids are unique: one left over is empty
                (d / "memory.max").write_text(str(memory_mb << 20))
                if (d / "memory.swap.max").exists():
                    (d / "memory.swap.max").write_text("0")
                (d / "cpu.max").write_text(f"{quota} {period}")
                (d / "pids.max").write_text(str(pids))
            else:
                for d in self.dirs:
                    d.mkdir(parents=True, exist_ok=True)
                mem, cpu, pid = self.dirs
                (mem / "memory.limit_in_bytes").write_text(str(memory_mb << 20))
                if (mem / "memory.memsw.limit_in_bytes").exists():  # no swapping past the limit either
                    (mem / "memory.memsw.limit_in_bytes").write_text(str(memory_mb << 20))
                (cpu / "cpu.cfs_period_us").write_text(str(period))
                (cpu / "cpu.cfs_quota_us").write_text(str(quota))
                (pid / "pids.max").write_text(str(pids))
        except OSError as e:
            self.remove()
            raise SandboxError(f"cannot make the VM's cgroup {self.dirs[0]}: {e.strerror or e}") from None
        return [d / "cgroup.procs" for d in self.dirs]

    def oom_kills(self) -> int:
        f = self.memory_dir / ("memory.events" if self.v2 else "memory.oom_control")
        try:
            fields = dict(line.split() for line in f.read_text().splitlines() if len(line.split()) == 2)
            return int(fields.get("oom_kill", 0))
        except (OSError, ValueError):
            return 0

    def remove(self) -> None:
        for d in self.dirs:
            _rmdir_cgroup(d)


def _rmdir_cgroup(d: Path, wait: float = 0.0) -> None:
    """Remove an empty cgroup; a process that is still exiting keeps it busy
    for a moment, which ``wait`` seconds allow for."""
    end = time.monotonic() + wait
    while True:
        try:
            d.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError as e:
            if e.errno != errno.EBUSY or time.monotonic() > end:
                log.warning("cannot remove cgroup %s: %s", d, e.strerror)
                return
            time.sleep(0.05)


class QMP:
    """A minimal QMP client: one command at a time, events are skipped."""

    def __init__(self, path: Path):
        self.path = path
        self.reader: Optional[asyncio.StreamReader] = None
        self.writer: Optional[asyncio.StreamWriter] = None
        self.lock = asyncio.Lock()

    async def connect(self, alive: Callable[[], bool], deadline: float = QMP_OPEN_TIMEOUT) -> None:
        """Connect once qemu listens; gives up at once when qemu has exited."""
        end = time.monotonic() + deadline
        while True:
            try:
                self.reader, self.writer = await asyncio.open_unix_connection(str(self.path), limit=1 << 20)
                break
            except OSError:
                if not alive():
                    raise SandboxError("qemu exited before its QMP socket opened") from None
                if time.monotonic() > end:
                    raise SandboxError(f"qemu's QMP socket did not open within {deadline:g} s") from None
                await asyncio.sleep(0.05)
        async with self.lock:
            await self._read()  # the greeting
        await self.execute("qmp_capabilities")

    @property
    def closed(self) -> bool:
        return self.writer is None or self.writer.is_closing() or (self.reader is not None and self.reader.at_eof())

    async def _read(self) -> Dict[str, Any]:
        assert self.reader
        while True:
            try:
                line = await asyncio.wait_for(self.reader.readline(), QMP_TIMEOUT)
            except asyncio.TimeoutError:
                # A late answer would be taken for the next command's: this connection is done.
                self.close()
                raise SandboxError(f"qemu did not answer on QMP within {QMP_TIMEOUT:g} s") from None
            except (ConnectionError, OSError):
                raise SandboxError("qemu closed its QMP socket") from None
            if not line:
                raise SandboxError("qemu closed its QMP socket")
            msg = json.loads(line)
            if "event" not in msg:
                return msg

    async def execute(self, command: str, fd: Optional[int] = None, **arguments: Any) -> Any:
        """Run one command; ``fd`` goes along with it as SCM_RIGHTS (``getfd``)."""
        if self.writer is None:
            raise SandboxError("qemu's QMP socket is not connected")
        data = json.dumps({"execute": command, "arguments": arguments}).encode() + b"\n"
        async with self.lock:
            try:
                if fd is None:
                    self.writer.write(data)
                    await self.writer.drain()
                else:  # nothing else is queued on the socket: one command at a time, drained
                    sock = self.writer.get_extra_info("socket")
                    with socket.socket(fileno=os.dup(sock.fileno())) as s:
                        socket.send_fds(s, [data], [fd])
                msg = await self._read()
            except (ConnectionError, OSError):
                raise SandboxError("qemu closed its QMP socket") from None
        if "error" in msg:
            raise SandboxError(f"qemu {command}: {msg['error'].get('desc', msg['error'])}")
        return msg.get("return")

    def close(self) -> None:
        if self.writer:
            self.writer.close()


class QemuSandbox(ProcessSandbox):
    def __init__(self, spec: SandboxSpec, driver: "QemuDriver"):
        super().__init__(spec)
        self.driver = driver
        self.console = ConsoleLog(spec.state_dir / "console.log")
        self.overlay = spec.state_dir / "root.qcow2"
        self.sockets = socket_dir(driver.home, spec.id, "q")
        self.qmp = QMP(self.sockets / "qmp.sock")
        self.config: Dict[str, Any] = {}  # what a restore must reproduce exactly
        self.uid: Optional[int] = None  # what qemu runs as once its files are open (a root gateway)
        self.cgroup: Optional[VMCgroup] = None
        self.log_path = self.sockets / "qemu.log"  # qemu's stderr: a file outlives the gateway, a pipe would not
        self._console_writer: Optional[asyncio.StreamWriter] = None

    @property
    def ws_overlay(self) -> Path:  # the workspace directory is renamed when a pooled VM is taken
        return self.spec.workspace / "workspace.qcow2"

    async def start(self, restore_from: Optional[Path] = None, consume: bool = False) -> None:
        from sandgate_images import vm

        self.spec.state_dir.mkdir(parents=True, exist_ok=True)
        self.spec.workspace.mkdir(parents=True, exist_ok=True)
        self.sockets.mkdir(mode=0o700, exist_ok=True)
        loop = asyncio.get_running_loop()
        image = await loop.run_in_executor(None, vm.build, self.driver.home)
        if restore_from:
            self.config = await self._layer_on(restore_from, consume)
        else:
            agent = await loop.run_in_executor(None, vm.agent_disk, self.driver.home)
            mode, why = await self.driver.accel(image)
            memory_mb, cpus = vm_shape(self.spec.limits)
            self.config = {"image": str(image), "agent": str(agent), "accel": mode, "memory_mb": memory_mb,
                           "cpus": cpus, "vsock": vhost_vsock()}
            await self.driver.run("qemu-img", "create", "-q", "-f", "qcow2", "-b", str(image / "root.ext4"),
                                  "-F", "raw", str(self.overlay))
            if not self.ws_overlay.exists():  # a restart keeps the workspace
                seed = self.spec.workspace_seed and self.spec.workspace_seed / "workspace.qcow2"
                base, fmt = (seed, "qcow2") if seed and seed.is_file() else (image / "workspace.ext4", "raw")
                await self.driver.run("qemu-img", "create", "-q", "-f", "qcow2", "-b", str(base), "-F", fmt,
                                      str(self.ws_overlay))
        for disk in (self.overlay, self.ws_overlay):  # root's alone: qemu opens them before it drops to its uid
            os.chmod(disk, 0o600)
        await self._spawn(restore_from)
        try:
            await self.qmp.connect(alive=lambda: self.proc.returncode is None)
            if restore_from:
                await self._finish_incoming()
        except SandboxError as e:
            # Whichever comes first, qemu's exit or its answer on QMP, the reason is the
            # same: what qemu said on its way out (stderr, the console), once it is gone.
            why = await self._exit_reason(str(e))
            raise SandboxError(("restoring the VM's state failed: " if restore_from else "qemu did not start: ")
                               + why) from None
        if restore_from and self.config["vsock"]:
            await self._qmp("cont")  # a stopped guest cannot accept a vsock connection
        await self._connect_agent(30 if restore_from else BOOT_TIMEOUT)
        if restore_from and not self.config["vsock"]:
            await self._qmp("cont")  # once the port's host end is connected, so nothing is lost

    async def _spawn(self, restore_from: Optional[Path]) -> None:
        """Start qemu, already in its cgroup (a shell joins it, then executes
        qemu), reading the state to restore from a descriptor it inherits."""
        argv = self.argv(restore_from)
        lim = self.spec.limits
        if os.geteuid() == 0:
            self.uid = self.driver.take_uid(self.spec.id)
            argv[1:1] = ["-runas", f"{self.uid}:{self.uid}"]
            self.cgroup = VMCgroup(f"{tag(str(self.driver.home))}-{self.spec.id}")
            memory_mb = self.config["memory_mb"] + OVERHEAD_MB.get(self.config["accel"], OVERHEAD_MB["tcg"])
            procs = await asyncio.get_running_loop().run_in_executor(
                None, self.cgroup.create, memory_mb, lim.cpus, VM_PIDS)
        else:  # qemu runs as the gateway's own unprivileged user, in its cgroup
            procs = []
        join = 'n=$1; shift; while [ "$n" -gt 0 ]; do echo $$ >"$1" || exit 125; n=$((n-1)); shift; done; exec "$@"'
        fd = None
        if restore_from:
            fd = os.open(restore_from / "state.mig", os.O_RDONLY | os.O_CLOEXEC)
            argv += ["-incoming", f"fd:{fd}"]
        try:
            with open(self.log_path, "ab") as stderr:
                self.proc = await asyncio.create_subprocess_exec(
                    "/bin/sh", "-c", join, "sh", str(len(procs)), *map(str, procs), *argv,
                    stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=stderr,
                    start_new_session=True, pass_fds=(fd,) if fd is not None else ())
        finally:
            if fd is not None:
                os.close(fd)
        if not procs:
            release(self.proc.pid)  # no cgroup of its own (unprivileged): the VM's memory is not the gateway's
        # qemu waits for this connection before it starts the guest: no console line is missed.
        await self._follow_console(QMP_OPEN_TIMEOUT)
        # What a later gateway process needs to adopt this VM (Driver.adopt).
        handle = {"pid": self.proc.pid, "uid": self.uid, "config": self.config, "spec": self.spec.model_dump(mode="json")}
        (self.sockets / "handle.json").write_text(json.dumps(handle))

    async def _follow_console(self, deadline: float) -> None:
        reader, self._console_writer = await connect_unix(self.sockets / "console.sock", lambda: self.running,
                                                          deadline, "qemu's console")
        self.console.follow(reader)  # the writer is kept: collecting it would close the socket

    def argv(self, restore_from: Optional[Path]) -> List[str]:
        c, d = self.config, self.sockets
        image = Path(c["image"])
        append = "console=ttyS0 quiet panic=-1"
        if c["vsock"]:
            append += f" sandgate.transport=vsock:{AGENT_VSOCK_PORT}"
            agent_dev = ["-device", f"vhost-vsock-device,guest-cid={self.cid}"]
        else:
            agent_dev = ["-device", "virtio-serial-device",
                         "-chardev", f"socket,id=agentc,path={d / 'agent.sock'},server=on,wait=off",
                         "-device", "virtserialport,chardev=agentc,name=sandgate"]
        accel = c["accel"]
        if c["accel"] == "tcg":
            accel += f",tb-size={TCG_TB_MB}"  # translated code is qemu's memory too: bounded
            if host_tsc_khz():
                append += f" tsc_early_khz={host_tsc_khz()}"
        append += " " + self.driver.settings.qemu_append  # for debugging a guest
        # auto-read-only=off: a disk's file stays open read-write for the VM's whole life.
        # qemu would otherwise reopen it by name when a migration deactivates or activates
        # the disk, which it can no longer do once it runs as its own uid.
        rw = "if=none,auto-read-only=off"
        return [qemu_path() or "qemu-system-x86_64", "-M", "microvm", "-accel", accel,
                "-m", str(c["memory_mb"]), "-smp", str(c["cpus"]),
                "-nodefaults", "-no-user-config", "-display", "none", "-sandbox", SECCOMP,
                # The console comes to the gateway on a socket (ConsoleLog bounds what it keeps),
                # which outlives a killed gateway where a pipe would break and kill qemu.
                "-chardev", f"socket,id=console,path={d / 'console.sock'},server=on,wait=on",
                "-serial", "chardev:console",
                "-kernel", str(image / "vmlinuz"), "-initrd", str(image / "initrd.gz"), "-append", append.strip(),
                "-drive", f"id=root,file={self.overlay},format=qcow2,{rw}", "-device", "virtio-blk-device,drive=root",
                "-drive", f"id=agent,file={c['agent']},format=raw,if=none,readonly=on",
                "-device", "virtio-blk-device,drive=agent",
                "-drive", f"id=ws,file={self.ws_overlay},format=qcow2,{rw}", "-device", "virtio-blk-device,drive=ws",
                *agent_dev, "-qmp", f"unix:{d / 'qmp.sock'},server=on,wait=off", "-no-reboot",
                "-name", f"sandgate-{tag(str(self.driver.home))}"]  # how reap() finds VMs of this home

    @property
    def cid(self) -> int:
        # A guest CID unique among this host's VMs: 3 and up, derived from the sandbox id.
        return 3 + int.from_bytes(self.id.encode()[-6:], "big") % 0xFFFFFFF0

    async def _layer_on(self, image_dir: Path, consume: bool) -> Dict[str, Any]:
        """Disks for a VM restored from ``image_dir``: the checkpoint's own
        overlays when it is consumed (resume), new ones on top otherwise."""
        try:
            config = json.loads((image_dir / "vm.json").read_text())
        except (OSError, ValueError):
            raise SandboxError(f"checkpoint image missing or damaged in {image_dir}") from None
        for f in ("state.mig", "root.qcow2", "workspace.qcow2"):
            if not (image_dir / f).is_file():
                raise SandboxError(f"checkpoint image damaged: {f} missing in {image_dir}")
        for f in (Path(config["image"]) / "vmlinuz", Path(config["agent"])):
            if not f.exists():
                raise SandboxError(f"checkpoint needs {f}, which is gone (was the VM image or agent rebuilt?)")
        if config["vsock"] and not vhost_vsock():
            raise SandboxError("checkpoint was taken with vhost-vsock, which this host lacks")
        if consume:
            shutil.move(str(image_dir / "root.qcow2"), self.overlay)
            shutil.move(str(image_dir / "workspace.qcow2"), self.ws_overlay)
        else:
            # resolve(): the checkpoint's own disk, not a link to it in a directory its chunked state
            # was assembled in for this restore (CheckpointStore.restorable), which goes away.
            for base, top in ((image_dir.joinpath("root.qcow2").resolve(), self.overlay),
                              (image_dir.joinpath("workspace.qcow2").resolve(), self.ws_overlay)):
                top.unlink(missing_ok=True)
                await self.driver.run("qemu-img", "create", "-q", "-f", "qcow2", "-b", str(base), "-F", "qcow2",
                                      str(top))
        return config

    async def _finish_incoming(self) -> None:
        """Wait for the incoming migration to complete. Any other outcome raises
        (the caller says why, from what qemu left once it is gone)."""
        end = time.monotonic() + 120
        while True:
            info = await self.qmp.execute("query-migrate")  # raises once qemu has exited
            status = info.get("status")
            if status == "completed":
                return
            if status in ("failed", "cancelled"):  # qemu exits right after, saying why on stderr
                raise SandboxError(f"migration {status}: {info.get('error-desc', '')}".rstrip(": "))
            if self.proc.returncode is not None:
                raise SandboxError(f"migration {status}")
            if time.monotonic() > end:
                raise SandboxError(f"migration not completed within 120 s (status {status})")
            await asyncio.sleep(0.05)

    async def _exit_reason(self, otherwise: str) -> str:
        """Why qemu stopped, once what it said on the way out is all in: the
        same words whether its exit or a failed QMP call was noticed first.
        ``otherwise``: what went wrong, if qemu does not exit."""
        if self.proc is None:
            return otherwise
        try:
            await asyncio.wait_for(asyncio.shield(self.proc.wait()), EXIT_GRACE)
        except asyncio.TimeoutError:
            return f"{otherwise} ({self.failure()})"
        await self._drained()
        return self.failure()

    async def _drained(self) -> None:
        """The console, read to its end (the process has exited)."""
        await self.console.drained()

    async def wait(self) -> int:
        assert self.proc, "sandbox not started"
        code = await self.proc.wait()
        await self._drained()  # so that failure() sees qemu's and the guest's last words
        return code

    async def _qmp(self, command: str, **arguments: Any) -> Any:
        """A QMP command on a VM that should be running; if qemu is gone, the
        error says why it stopped rather than that its socket closed."""
        try:
            return await self.qmp.execute(command, **arguments)
        except SandboxError as e:
            if self.qmp.closed:
                raise SandboxError(f"the VM stopped: {await self._exit_reason(str(e))}") from None
            raise

    async def _connect_agent(self, deadline: float) -> None:
        end = time.monotonic() + deadline
        while True:
            try:
                if self.config["vsock"]:
                    sock = socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)
                    sock.setblocking(False)
                    await asyncio.get_running_loop().sock_connect(sock, (self.cid, AGENT_VSOCK_PORT))
                    self.reader, self.writer = await asyncio.open_connection(sock=sock, limit=1 << 20)
                else:
                    self.reader, self.writer = await asyncio.open_unix_connection(
                        str(self.sockets / "agent.sock"), limit=1 << 20)
                return
            except OSError as e:
                # vsock refuses until the guest agent listens; the gateway's start
                # timeout bounds the boot, this loop only the connection.
                if self.proc.returncode is not None or time.monotonic() > end:
                    why = await self._exit_reason(f"{e.strerror or e} after {deadline:g} s")
                    raise SandboxError(f"cannot reach the guest agent: {why}") from None
                await asyncio.sleep(0.1)

    def qemu_said(self, what: str) -> str:
        """``what`` went wrong, with what qemu said about it on stderr."""
        said = [ln for ln in tail_lines(self.log_path) if "qemu" in ln][-2:]
        return what + (f" ({' | '.join(said)})" if said else "")

    def failure(self) -> str:
        code = self.proc.returncode if self.proc else None
        oom = self.cgroup.oom_kills() if self.cgroup else 0
        if code is None:
            what = "VM is running"
        elif oom:
            what = f"VM was killed: over its memory limit ({self.config['memory_mb']} MB and qemu's overhead)"
        elif code in (-9, 137):
            what = "VM was killed (SIGKILL)"
        elif code == AdoptedProcess.UNKNOWN and isinstance(self.proc, AdoptedProcess):
            what = "VM exited (an earlier gateway process started it: only that one could see its exit status)"
        elif code == -31:
            what = "qemu was killed by its seccomp filter (SIGSYS)"
        else:
            what = f"VM exited with status {code}"
        lines = self.console.lines()
        panic = [ln for ln in lines if "Kernel panic" in ln or "sandgate-init" in ln or "Error" in ln]
        said = [ln for ln in tail_lines(self.log_path) if ("qemu" in ln or ln.startswith("sh:")) and "waiting for" not in ln]
        tail = (panic or lines)[-3:] + said[-2:]
        return what + (": " + " | ".join(tail) if tail else "")

    async def stop(self) -> None:
        self.qmp.close()
        self.console.close()
        if self._console_writer:
            self._console_writer.close()
        if self.writer:
            self.writer.close()
        if self.proc and self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()

    async def destroy(self) -> None:
        await self.stop()
        if self.cgroup:
            self.cgroup.remove()  # empty now: qemu has exited and was waited for
        if self.uid is not None:
            self.driver.uids.discard(self.uid)
        shutil.rmtree(self.spec.state_dir, ignore_errors=True)
        shutil.rmtree(self.sockets, ignore_errors=True)


class QemuDriver(Driver):
    name = "qemu"
    sync_before_checkpoint = True
    env_at_boot = False  # the guest boots from a shared image: the core sends env in `setup`
    env_at_boot = False  # the guest boots from a shared image: the core sends env in `setup`
    shares_workspace = False  # its workspace is a qcow2/raw disk kept in the workspace directory
    state_images = ("state.mig",)  # the migration stream; the overlays are backing files, kept whole
    layered_checkpoints = True  # those overlays back the next checkpoint's and the restored VM's disks

    def __init__(self, root_dir: str, settings: "Settings"):
        self.home = Path(root_dir).parents[1]
        self.settings = settings
        self._accel: Optional[Tuple[str, str]] = None
        self._accel_lock = asyncio.Lock()
        self.uids: set = set()  # those of this gateway's running VMs

    @classmethod
    def probe(cls, settings: "Settings") -> Tuple[bool, str]:
        path = qemu_path()
        if not path:
            return False, "qemu-system-x86_64 not found (apt-get install qemu-system-x86 qemu-utils)"
        if not (shutil.which("mkfs.ext4") and shutil.which("qemu-img") and shutil.which("apt-get")):
            return False, "needs mkfs.ext4, qemu-img and apt-get to build its image"
        return True, f"qemu at {path} (KVM if a trial boot under it works, else TCG)"

    async def accel(self, image: Path) -> Tuple[str, str]:
        async with self._accel_lock:
            if self._accel is None:
                self._accel = await asyncio.get_running_loop().run_in_executor(None, accel, self.home, image,
                                                                           self.settings.qemu_accel)
                log.info("qemu acceleration: %s (%s)", *self._accel)
            return self._accel

    def take_uid(self, sandbox_id: str) -> int:
        """A uid (and gid) for one VM: its own among this gateway's VMs, the
        same across gateways only by a hash collision, never an account's."""
        h = int.from_bytes(hashlib.sha256(f"{self.home}:{sandbox_id}".encode()).digest()[:8], "big")
        for i in range(UID_SPAN):
            uid = UID_BASE + (h + i) % UID_SPAN
            if uid in self.uids:
                continue
            if unused_id(uid):
                self.uids.add(uid)
                return uid
        raise SandboxError("no free uid for another VM")

    async def run(self, *cmd: str) -> None:
        p = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE,
                                                 stderr=asyncio.subprocess.STDOUT)
        out, _ = await p.communicate()
        if p.returncode != 0:
            raise SandboxError(f"{cmd[0]} failed: {out.decode(errors='replace').strip()[-300:]}")

    async def create(self, spec: SandboxSpec, restore_from: Optional[Path] = None,
                     consume: bool = False) -> Sandbox:
        sb = QemuSandbox(spec, self)
        try:
            await sb.start(restore_from, consume)
        except BaseException as e:  # cancelled too: the VM runs in its own session and would outlive us
            await sb.stop()
            if consume and restore_from:  # put the consumed overlays back first: nothing is lost
                for src, dst in ((sb.overlay, restore_from / "root.qcow2"),
                                 (sb.ws_overlay, restore_from / "workspace.qcow2")):
                    if src.exists() and not dst.exists():
                        shutil.move(str(src), dst)
            await sb.destroy()
            if isinstance(e, SandboxError) or not isinstance(e, Exception):  # cancellation included
                raise
            raise SandboxError(f"could not start the VM: {e}") from None
        return sb

    async def checkpoint(self, sandbox: Sandbox, image_dir: Path) -> None:
        assert isinstance(sandbox, QemuSandbox)
        image_dir.mkdir(parents=True, exist_ok=True)
        # Migration skips zero pages, so the state is at most the guest's RAM.
        require_disk_for_checkpoint(image_dir, (sandbox.config["memory_mb"] << 20) + (16 << 20))
        qmp = sandbox.qmp
        state = image_dir / "state.mig"
        try:
            try:
                await qmp.execute("stop")
                await qmp.execute("migrate-set-parameters", **{"max-bandwidth": 1 << 40})  # the default throttles
                # The gateway opens the file and hands it over: qemu may neither open files
                # (it runs as its own uid) nor start `cat` (its seccomp filter denies exec).
                fd = os.open(state, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
                try:
                    await qmp.execute("getfd", fd=fd, fdname="sandgate-state")
                finally:
                    os.close(fd)
                await qmp.execute("migrate", uri="fd:sandgate-state")
                end = time.monotonic() + 120
                while True:
                    info = await qmp.execute("query-migrate")
                    if info.get("status") == "completed":
                        break
                    if info.get("status") in ("failed", "cancelled") or time.monotonic() > end:
                        raise SandboxError(info.get("error-desc", info.get("status")))
                    await asyncio.sleep(0.05)
            except SandboxError as e:
                # qemu gone (its QMP closed) or alive: say which, the same way whatever came first.
                if qmp.closed:
                    why = await sandbox._exit_reason(str(e))
                else:
                    await asyncio.sleep(0.1)  # qemu wrote why on stderr before it answered: let it arrive
                    why = sandbox.qemu_said(str(e))
                raise SandboxError(f"saving the VM's state failed: {why}") from None
        except BaseException:
            state.unlink(missing_ok=True)
            if sandbox.running:
                try:
                    await qmp.execute("cont")  # the VM carries on as if nothing happened
                except SandboxError:
                    await sandbox.stop()  # not left frozen beyond our control: it is reported dead
            raise
        await sandbox.stop()
        # The overlays are frozen as of the stop: they are the checkpoint's disks. The
        # manifest goes first; if a move fails, what moved goes back, so no disk is lost.
        (image_dir / "vm.json").write_text(json.dumps(sandbox.config))
        moves = ((sandbox.overlay, image_dir / "root.qcow2"), (sandbox.ws_overlay, image_dir / "workspace.qcow2"))
        try:
            for src, dst in moves:
                shutil.move(str(src), dst)
        except OSError as e:
            for src, dst in moves:
                if dst.exists() and not src.exists():
                    shutil.move(str(dst), src)
            raise SandboxError(f"checkpoint failed after the VM stopped: {e}") from None

    def restore_compatible(self, spec: SandboxSpec, image_dir: Path) -> Optional[str]:
        """None if ``image_dir`` can be restored for ``spec``, else why not.

        A migration restores only into a machine of the shape it was saved
        from: the same memory and vCPUs (``vm.json``). A sandbox that asks for
        other limits cannot start from that checkpoint (the template, say):
        the caller cold-boots it instead. ``restore`` refuses it with this
        same reason."""
        try:
            config = json.loads((image_dir / "vm.json").read_text())
            have = (int(config["memory_mb"]), int(config["cpus"]))
        except (OSError, ValueError, KeyError, TypeError):
            return f"checkpoint image missing or damaged in {image_dir}"
        want = vm_shape(spec.limits)
        if want != have:
            return (f"the checkpoint's VM has {have[0]} MB of memory and {have[1]} vCPU(s), the sandbox's limits "
                    f"ask for {want[0]} MB and {want[1]} vCPU(s): a VM restores only with the memory and vCPUs "
                    f"it was saved with")
        return None

    async def restore(self, spec: SandboxSpec, image_dir: Path, consume: bool = False) -> Sandbox:
        why = self.restore_compatible(spec, image_dir)
        if why:
            raise SandboxError(why)
        return await self.create(spec, restore_from=image_dir, consume=consume)

    async def freeze(self, sandbox: Sandbox) -> None:
        assert isinstance(sandbox, QemuSandbox)
        await sandbox._qmp("stop")

    async def thaw(self, sandbox: Sandbox) -> None:
        assert isinstance(sandbox, QemuSandbox)
        await sandbox._qmp("cont")

    async def adopt(self, runtime: str) -> Sandbox:
        """A VM outlives a killed gateway (its own session); its QMP and agent
        sockets take the next gateway process's connections."""
        sockets = socket_dir(self.home, runtime, "q")
        try:
            handle = json.loads((sockets / "handle.json").read_text())
            spec = SandboxSpec.model_validate(handle["spec"])
        except (OSError, ValueError, KeyError) as e:
            raise SandboxError(f"no handle on VM {runtime}: {e}") from None
        sb = QemuSandbox(spec, self)
        sb.config, sb.uid = handle["config"], handle["uid"]
        sb.proc = AdoptedProcess(handle["pid"], str(sockets / "qmp.sock"))
        if sb.uid is not None:
            self.uids.add(sb.uid)
            sb.cgroup = VMCgroup(f"{tag(str(self.home))}-{spec.id}")
        try:
            await sb._follow_console(QMP_TIMEOUT)
            await sb.qmp.connect(alive=lambda: sb.proc.returncode is None, deadline=QMP_TIMEOUT)
            await sb._connect_agent(QMP_TIMEOUT)
        except BaseException:
            await sb.stop()
            raise
        return sb

    async def reap(self, keep: Iterable[str] = ()) -> int:
        """Kill VMs an earlier gateway process on this home left running,
        except those adopted (``keep``), and remove their sockets and cgroups."""
        home = tag(str(self.home))
        kept = {socket_dir(self.home, i, "q") for i in keep}
        markers = {str(d / "qmp.sock").encode() for d in kept}
        name = f"sandgate-{home}".encode()
        killed = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if argv[0].endswith(b"qemu-system-x86_64") and name in argv and not any(
                    m in arg for m in markers for arg in argv):
                try:
                    os.kill(int(pid), signal.SIGKILL)
                    killed.append(int(pid))
                except ProcessLookupError:
                    pass
        for d in Path(tempfile.gettempdir()).glob(f"sgq-{home}-*"):
            if d not in kept:
                shutil.rmtree(d, ignore_errors=True)
        # A killed VM leaves its cgroup once it is gone (its new parent reaps it).
        keep_cg = {f"{home}-{i}" for i in keep}
        cgroups = [d for c in VMCgroup("x").dirs for d in c.parent.glob(f"{home}-*") if d.name not in keep_cg]
        if cgroups:
            await asyncio.get_running_loop().run_in_executor(
                None, lambda: [_rmdir_cgroup(d, wait=10 if killed else 0) for d in cgroups])
        return len(killed)
