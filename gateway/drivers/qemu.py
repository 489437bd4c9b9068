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
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from .base import Driver, ProcessSandbox, Sandbox, SandboxError, SandboxSpec
from .console import ConsoleLog

log = logging.getLogger("sandgate.qemu")

AGENT_VSOCK_PORT = 1024
PROBE_TIMEOUT = 10.0  # a KVM guest reaches userspace in well under a second
BOOT_TIMEOUT = 120.0  # until a vsock agent listens: guest boot plus Python (the serial socket is qemu's own)
QMP_TIMEOUT = 30.0


def qemu_path() -> Optional[str]:
    return shutil.which("qemu-system-x86_64")


def _tag(path: Path) -> str:
    return hashlib.sha256(str(path).encode()).hexdigest()[:10]


def socket_dir(home: Path, state_dir: Path) -> Path:
    """Where a VM's unix sockets go: a unix socket path must stay under 108
    bytes, which a sandbox's state directory may well exceed."""
    return Path(tempfile.gettempdir()) / f"sgq-{_tag(home)}-{_tag(state_dir)}"


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


def accel(home: Path, image: Path) -> Tuple[str, str]:
    """``kvm`` or ``tcg`` and why. The trial boot's answer is remembered per
    guest image, host kernel and qemu binary, in home/images/qemu-accel.json."""
    forced = os.environ.get("SANDGATE_QEMU_ACCEL")
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


class QMP:
    """A minimal QMP client: one command at a time, events are skipped."""

    def __init__(self, path: Path):
        self.path = path
        self.reader: Optional[asyncio.StreamReader] = None
        self.writer: Optional[asyncio.StreamWriter] = None

    async def connect(self, deadline: float = 10.0) -> None:
        end = time.monotonic() + deadline
        while True:
            try:
                self.reader, self.writer = await asyncio.open_unix_connection(str(self.path), limit=1 << 20)
                break
            except OSError:
                if time.monotonic() > end:
                    raise SandboxError("qemu's QMP socket did not open") from None
                await asyncio.sleep(0.05)
        await self._read()  # the greeting
        await self.execute("qmp_capabilities")

    async def _read(self) -> Dict[str, Any]:
        assert self.reader
        while True:
            try:
                line = await asyncio.wait_for(self.reader.readline(), QMP_TIMEOUT)
            except asyncio.TimeoutError:
                # A late answer would be taken for the next command's: this connection is done.
                self.close()
                raise SandboxError(f"qemu did not answer on QMP within {QMP_TIMEOUT:g} s") from None
            if not line:
                raise SandboxError("qemu closed its QMP socket")
            msg = json.loads(line)
            if "event" not in msg:
                return msg

    async def execute(self, command: str, **arguments: Any) -> Any:
        assert self.writer
        try:
            self.writer.write(json.dumps({"execute": command, "arguments": arguments}).encode() + b"\n")
            await self.writer.drain()
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
        self.sockets = socket_dir(driver.home, spec.state_dir)
        self.qmp = QMP(self.sockets / "qmp.sock")
        self.config: Dict[str, Any] = {}  # what a restore must reproduce exactly
        self._stderr: List[str] = []

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
            lim = self.spec.limits
            self.config = {"image": str(image), "agent": str(agent), "accel": mode, "memory_mb": lim.memory_mb,
                           "cpus": max(1, int(lim.cpus)), "vsock": vhost_vsock()}
            await self.driver.run("qemu-img", "create", "-q", "-f", "qcow2", "-b", str(image / "root.ext4"),
                                  "-F", "raw", str(self.overlay))
            if not self.ws_overlay.exists():  # a restart keeps the workspace
                seed = self.spec.workspace_seed and self.spec.workspace_seed / "workspace.qcow2"
                base, fmt = (seed, "qcow2") if seed and seed.is_file() else (image / "workspace.ext4", "raw")
                await self.driver.run("qemu-img", "create", "-q", "-f", "qcow2", "-b", str(base), "-F", fmt,
                                      str(self.ws_overlay))
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv(restore_from), stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, start_new_session=True)
        self.console.follow(self.proc.stdout)
        asyncio.ensure_future(self._drain_stderr())
        try:
            await self.qmp.connect()
        except SandboxError:
            await self.console.drained()
            raise SandboxError(f"qemu did not start: {self.failure()}") from None
        if restore_from:
            await self._finish_incoming()
            if self.config["vsock"]:
                await self.qmp.execute("cont")  # a stopped guest cannot accept a vsock connection
        await self._connect_agent(30 if restore_from else BOOT_TIMEOUT)
        if restore_from and not self.config["vsock"]:
            await self.qmp.execute("cont")  # once the port's host end is connected, so nothing is lost

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
        if c["accel"] == "tcg" and host_tsc_khz():
            append += f" tsc_early_khz={host_tsc_khz()}"
        append += " " + os.environ.get("SANDGATE_QEMU_APPEND", "")  # for debugging a guest
        argv = [qemu_path() or "qemu-system-x86_64", "-M", "microvm", "-accel", c["accel"],
                "-m", str(c["memory_mb"]), "-smp", str(c["cpus"]),
                "-nodefaults", "-no-user-config", "-display", "none",
                # the console comes to the gateway on a pipe, which bounds what it keeps
                "-chardev", "stdio,id=console,signal=off", "-serial", "chardev:console",
                "-kernel", str(image / "vmlinuz"), "-initrd", str(image / "initrd.gz"), "-append", append.strip(),
                "-drive", f"id=root,file={self.overlay},format=qcow2,if=none", "-device", "virtio-blk-device,drive=root",
                "-drive", f"id=agent,file={c['agent']},format=raw,if=none,readonly=on",
                "-device", "virtio-blk-device,drive=agent",
                "-drive", f"id=ws,file={self.ws_overlay},format=qcow2,if=none", "-device", "virtio-blk-device,drive=ws",
                *agent_dev, "-qmp", f"unix:{d / 'qmp.sock'},server=on,wait=off", "-no-reboot",
                "-name", f"sandgate-{_tag(self.driver.home)}"]  # how reap() finds VMs of this home
        if restore_from:
            argv += ["-incoming", "exec:cat " + shlex.quote(str(restore_from / "state.mig"))]
        return argv

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
            for base, top in ((image_dir / "root.qcow2", self.overlay),
                              (image_dir / "workspace.qcow2", self.ws_overlay)):
                top.unlink(missing_ok=True)
                await self.driver.run("qemu-img", "create", "-q", "-f", "qcow2", "-b", str(base), "-F", "qcow2",
                                      str(top))
        return config

    async def _finish_incoming(self) -> None:
        end = time.monotonic() + 120
        while True:
            try:
                status = (await self.qmp.execute("query-migrate")).get("status")
            except SandboxError:  # qemu exits when it cannot load the state: its stderr says why
                await asyncio.wait({asyncio.ensure_future(self.proc.wait())}, timeout=5)
                await self.console.drained()
                raise SandboxError(f"restoring the VM's state failed: {self.failure()}") from None
            if status == "completed":
                return
            if status == "failed" or self.proc.returncode is not None or time.monotonic() > end:
                raise SandboxError(f"restoring the VM's state failed: {status}; {self.failure()}")
            await asyncio.sleep(0.05)

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
            except OSError:
                # vsock refuses until the guest agent listens; the gateway's start
                # timeout bounds the boot, this loop only the connection.
                if self.proc.returncode is not None or time.monotonic() > end:
                    raise SandboxError(f"cannot reach the guest agent: {self.failure()}") from None
                await asyncio.sleep(0.1)

    async def _drain_stderr(self) -> None:
        assert self.proc and self.proc.stderr
        async for line in self.proc.stderr:
            self._stderr = (self._stderr + [line.decode(errors="replace").rstrip()])[-10:]

    def failure(self) -> str:
        code = self.proc.returncode if self.proc else None
        if code is None:
            what = "VM is running"
        elif code in (-9, 137):
            what = "VM was killed (SIGKILL)"
        else:
            what = f"VM exited with status {code}"
        lines = self.console.lines()
        panic = [ln for ln in lines if "Kernel panic" in ln or "sandgate-init" in ln or "Error" in ln]
        tail = (panic or lines)[-3:] + [ln for ln in self._stderr if "qemu" in ln][-2:]
        return what + (": " + " | ".join(tail) if tail else "")

    async def stop(self) -> None:
        self.qmp.close()
        self.console.close()
        if self.writer:
            self.writer.close()
        if self.proc and self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()

    async def destroy(self) -> None:
        await self.stop()
        shutil.rmtree(self.spec.state_dir, ignore_errors=True)
        shutil.rmtree(self.sockets, ignore_errors=True)


class QemuDriver(Driver):
    name = "qemu"
    sync_before_checkpoint = True

    def __init__(self, root_dir: str):
        self.home = Path(root_dir).parents[1]
        self._accel: Optional[Tuple[str, str]] = None
        self._accel_lock = asyncio.Lock()

    @classmethod
    def probe(cls) -> Tuple[bool, str]:
        path = qemu_path()
        if not path:
            return False, "qemu-system-x86_64 not found (apt-get install qemu-system-x86 qemu-utils)"
        if not (shutil.which("mkfs.ext4") and shutil.which("qemu-img") and shutil.which("apt-get")):
            return False, "needs mkfs.ext4, qemu-img and apt-get to build its image"
        return True, f"qemu at {path} (KVM if a trial boot under it works, else TCG)"

    async def accel(self, image: Path) -> Tuple[str, str]:
        async with self._accel_lock:
            if self._accel is None:
                self._accel = await asyncio.get_running_loop().run_in_executor(None, accel, self.home, image)
                log.info("qemu acceleration: %s (%s)", *self._accel)
            return self._accel

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
        need = (sandbox.config["memory_mb"] << 20) + (16 << 20)
        st = os.statvfs(image_dir)
        if st.f_bavail * st.f_frsize < need:
            raise SandboxError(f"not enough disk space for a checkpoint: {(st.f_bavail * st.f_frsize) >> 20} MB "
                               f"free in {image_dir.parent}, up to {need >> 20} MB needed")
        qmp = sandbox.qmp
        try:
            await qmp.execute("stop")
            await qmp.execute("migrate-set-parameters", **{"max-bandwidth": 1 << 40})  # the default throttles
            await qmp.execute("migrate", uri="exec:cat > " + shlex.quote(str(image_dir / "state.mig")))
            end = time.monotonic() + 120
            while True:
                info = await qmp.execute("query-migrate")
                if info.get("status") == "completed":
                    break
                if info.get("status") in ("failed", "cancelled") or time.monotonic() > end:
                    raise SandboxError(f"saving the VM's state failed: {info.get('error-desc', info.get('status'))}")
                await asyncio.sleep(0.05)
        except BaseException:
            (image_dir / "state.mig").unlink(missing_ok=True)
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

    async def restore(self, spec: SandboxSpec, image_dir: Path, consume: bool = False) -> Sandbox:
        return await self.create(spec, restore_from=image_dir, consume=consume)

    async def freeze(self, sandbox: Sandbox) -> None:
        assert isinstance(sandbox, QemuSandbox)
        await sandbox.qmp.execute("stop")

    async def thaw(self, sandbox: Sandbox) -> None:
        assert isinstance(sandbox, QemuSandbox)
        await sandbox.qmp.execute("cont")

    async def reap(self) -> int:
        """Kill VMs an earlier gateway process on this home left running."""
        name = f"sandgate-{_tag(self.home)}".encode()
        n = 0
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if argv[0].endswith(b"qemu-system-x86_64") and name in argv:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                    n += 1
                except ProcessLookupError:
                    pass
        for d in Path(tempfile.gettempdir()).glob(f"sgq-{_tag(self.home)}-*"):
            shutil.rmtree(d, ignore_errors=True)
        return n
