"""Firecracker microVM sandboxes: one Firecracker process per VM, driven over
its HTTP API on a unix socket (see docs/firecracker.md).

The guest is the image from images/vm.py: the Debian cloud kernel (as the
ELF vmlinux Firecracker loads, images/vmlinux.py), the initramfs, and three
virtio-block disks: the shared root (read-only), the agent bundle
(read-only) and the workspace, a raw ext4 file kept in the sandbox's
workspace directory so it survives a cold restart. The agent listens on
vsock port 1024 (``sandgate.transport=vsock:1024``); the host reaches it
through Firecracker's vsock unix socket with ``CONNECT 1024``. There is no
network interface.

Every path Firecracker is given is relative: to its working directory
(state_dir), or with the jailer (SANDGATE_FIRECRACKER_JAILER) to its chroot.
A snapshot holds those relative paths, so a VM restored in a new directory
with the same names finds its own disks and binds its own vsock socket.
That is what Firecracker's snapshot docs ask for ("the same relative
paths") and it works on every release, unlike ``vsock_override`` (1.16+).

Checkpoints are Full snapshots (vmstate + mem) plus the workspace disk.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Tuple

from ..confine import release
from .base import Driver, ProcessSandbox, Sandbox, SandboxError, SandboxSpec, require_disk_for_checkpoint
from .console import ConsoleLog

if TYPE_CHECKING:  # config imports this package (Limits): the settings come in as arguments
    from ..config import Settings

AGENT_PORT = 1024
GUEST_CID = 3  # the first CID a guest may have; every VM has its own vsock device
# reboot=k panic=1: a panicking guest resets, and Firecracker exits on a guest reset.
BOOT_ARGS = ("console=ttyS0 reboot=k panic=1 quiet i8042.noaux i8042.nomux i8042.dumbkbd "
             f"sandgate.transport=vsock:{AGENT_PORT}")
BOOT_TIMEOUT = 120.0  # until the agent accepts on vsock: guest boot plus ipykernel start
API_TIMEOUT = 15.0
SNAPSHOT_TIMEOUT = 300.0  # writing or mapping the memory file
# Names inside the VM's directory (or chroot); they are baked into snapshots.
KERNEL, INITRD, ROOT, AGENT, WORKSPACE = "vmlinux", "initrd.gz", "root.ext4", "agent.ext4", "workspace.raw"
API_SOCK, VSOCK, VMSTATE, MEM = "api.sock", "v.sock", "vmstate", "mem"
# A new snapshot never goes to the loaded files' names: those may be hard links
# to another checkpoint's files, which Firecracker would truncate and overwrite.
NEW_VMSTATE, NEW_MEM = "snapshot.vmstate", "snapshot.mem"
MANIFEST = "firecracker.json"


def firecracker_path(configured: str = "") -> Optional[str]:
    """The firecracker binary: the firecracker_bin setting, else the one on PATH."""
    path = configured or shutil.which("firecracker")
    return os.path.abspath(path) if path else None  # VMs run in their own directory


def jailer_path(configured: str = "") -> Optional[str]:
    return os.path.abspath(configured) if configured else None


async def unix_connect(path: Path, limit: int = 1 << 20):
    """open_unix_connection, also for paths past the 107-byte sun_path limit:
    those are reached through /proc/self/fd/N of their directory."""
    if len(os.fsencode(str(path))) < 100:
        return await asyncio.open_unix_connection(str(path), limit=limit)
    fd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY)
    try:
        return await asyncio.open_unix_connection(f"/proc/self/fd/{fd}/{path.name}", limit=limit)
    finally:
        os.close(fd)


async def api_call(sock: Path, method: str, path: str, body: Optional[dict] = None,
                   timeout: float = API_TIMEOUT) -> Optional[dict]:
    """One HTTP/1.1 request on Firecracker's API socket; SandboxError with
    Firecracker's fault_message unless it answers 200 or 204."""
    data = json.dumps(body).encode() if body is not None else b""
    head = (f"{method} {path} HTTP/1.1\r\nHost: localhost\r\nAccept: application/json\r\n"
            + (f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n" if body is not None else "")
            + "\r\n")

    async def exchange() -> Tuple[int, bytes]:
        reader, writer = await unix_connect(sock)
        try:
            writer.write(head.encode() + data)
            await writer.drain()
            status_line = await reader.readline()
            parts = status_line.split(None, 2)
            if len(parts) < 2 or not parts[0].startswith(b"HTTP/"):
                raise ConnectionError(f"not an HTTP answer: {status_line[:80]!r}")
            length = 0
            while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value.strip())
            return int(parts[1]), await reader.readexactly(length) if length else b""
        finally:
            writer.close()

    try:
        status, payload = await asyncio.wait_for(exchange(), timeout)
    except asyncio.TimeoutError:
        raise SandboxError(f"Firecracker did not answer {method} {path} within {timeout:g} s") from None
    except (OSError, ConnectionError, asyncio.IncompleteReadError, ValueError) as e:
        raise SandboxError(f"Firecracker API unreachable for {method} {path}: {e}") from None
    if status in (200, 204):
        return json.loads(payload) if payload.strip() else None
    try:
        fault = json.loads(payload).get("fault_message") or payload.decode(errors="replace")
    except ValueError:
        fault = payload.decode(errors="replace") or "no error message"
    raise SandboxError(f"Firecracker refused {method} {path} ({status}): {fault}")


def link_or_copy(src: Path, dst: Path, symlink_ok: bool) -> None:
    """A name for ``src`` inside a VM's directory: a hard link (shares the
    inode, so a jailed Firecracker can reach it), else a symlink when not
    jailed, else a sparse copy."""
    try:
        os.link(src, dst)
        return
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
            raise
    if symlink_ok:
        os.symlink(os.path.abspath(src), dst)
    else:
        sparse_copy(src, dst)


def sparse_copy(src: Path, dst: Path) -> None:
    # cp keeps holes (a fresh 1 GiB workspace disk is a few MiB) and reflinks where it can.
    p = subprocess.run(["cp", "--sparse=always", "--reflink=auto", str(src), str(dst)],
                       capture_output=True, text=True)
    if p.returncode != 0:
        raise OSError(f"cp {src} {dst}: {p.stderr.strip()}")


def apply_diff(diff: Path, target: Path) -> int:
    """Write the data regions of the sparse memory file ``diff`` (a Diff
    snapshot: dirty pages only, holes elsewhere) over ``target``, the full
    memory it is relative to; returns the bytes written. Relies on SEEK_DATA,
    which every local Linux filesystem answers (one that cannot reports the
    whole file as data, holes would then overwrite pages with zeros)."""
    written = 0
    with open(diff, "rb") as src, open(target, "r+b") as dst:
        fd, end = src.fileno(), os.fstat(src.fileno()).st_size
        if os.fstat(dst.fileno()).st_size != end:
            raise OSError(f"a Diff snapshot of {end} bytes cannot apply to {target} "
                          f"({os.fstat(dst.fileno()).st_size} bytes)")
        offset = 0
        while offset < end:
            try:
                start = os.lseek(fd, offset, os.SEEK_DATA)
            except OSError as e:
                if e.errno == errno.ENXIO:  # no data past offset
                    break
                raise
            offset = os.lseek(fd, start, os.SEEK_HOLE)
            pos = start
            while pos < offset:
                chunk = os.pread(fd, min(offset - pos, 1 << 20), pos)
                os.pwrite(dst.fileno(), chunk, pos)
                pos += len(chunk)
            written += offset - start
        dst.flush()
        os.fsync(dst.fileno())
    return written


def move(src: Path, dst: Path) -> None:
    try:
        os.replace(src, dst)
    except OSError as e:
        if e.errno != errno.EXDEV:
            raise
        sparse_copy(src, dst)
        src.unlink()


class FirecrackerSandbox(ProcessSandbox):
    def __init__(self, spec: SandboxSpec, driver: "FirecrackerDriver"):
        super().__init__(spec)
        self.driver = driver
        self.jailer = jailer_path(driver.settings.firecracker_jailer)
        self.console = ConsoleLog(spec.state_dir / "console.log")
        if self.jailer:
            base = Path(driver.settings.firecracker_chroot_base or spec.state_dir / "jail")
            # the jailer names the chroot after the resolved binary: <base>/<exec name>/<id>/root
            exec_name = Path(os.path.realpath(firecracker_path(driver.settings.firecracker_bin) or "firecracker")).name
            self.jail_top: Optional[Path] = base / exec_name / spec.id
            self.root = self.jail_top / "root"
        else:
            self.jail_top = None
            self.root = spec.state_dir
        self.api_sock = self.root / API_SOCK

    # -- files ----------------------------------------------------------
    def prepare(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)  # a stale api.sock would look like a started VM
        self.spec.state_dir.mkdir(parents=True, exist_ok=True)
        self.spec.workspace.mkdir(parents=True, exist_ok=True)
        self.root.mkdir(parents=True, exist_ok=True)
        self.driver.register(self)

    def place(self, src: Path, name: str) -> None:
        link_or_copy(src, self.root / name, symlink_ok=not self.jailer)

    def place_workspace(self) -> None:
        """The workspace disk must be the very file in spec.workspace, so no copy."""
        disk, dst = self.spec.workspace / WORKSPACE, self.root / WORKSPACE
        try:
            os.link(disk, dst)
        except OSError as e:
            if self.jailer or e.errno not in (errno.EXDEV, errno.EPERM):
                raise SandboxError(f"cannot hard-link the workspace disk into {self.root}: {e}") from None
            os.symlink(disk, dst)
        if self.jailer:
            os.chown(disk, self.driver.uid, self.driver.gid)

    def shares_memory(self) -> bool:
        """Whether the memory file this VM loaded is also a checkpoint's."""
        mem = self.root / MEM
        return mem.is_symlink() or os.lstat(mem).st_nlink > 1

    def workspace_disk(self) -> Path:
        """The workspace disk this VM has open, wherever its directory is now."""
        p = self.root / WORKSPACE
        return Path(os.path.realpath(p)) if p.is_symlink() else p

    # -- process --------------------------------------------------------
    async def launch(self) -> None:
        fc = firecracker_path(self.driver.settings.firecracker_bin)
        if not fc:
            raise SandboxError("firecracker not found: set FIRECRACKER_BIN or put it on PATH")
        if self.jailer:
            argv = [self.jailer, "--id", self.id, "--exec-file", fc, "--uid", str(self.driver.uid),
                    "--gid", str(self.driver.gid), "--chroot-base-dir", str(self.jail_top.parents[1]),
                    *shlex.split(self.driver.settings.firecracker_jailer_args),
                    "--", "--api-sock", API_SOCK]
        else:
            argv = [fc, "--api-sock", API_SOCK, "--id", self.id]
        # Firecracker writes the guest's serial console and its own log to stdout/stderr.
        self.proc = await asyncio.create_subprocess_exec(
            *argv, cwd=self.root, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT, start_new_session=True)
        release(self.proc.pid)  # the VM's memory is not the gateway's
        self.console.follow(self.proc.stdout)
        self.driver.register(self)
        # The socket file appears at bind(), a moment before listen(): ready is when it accepts.
        deadline = time.monotonic() + 10
        while not await self._api_accepts():
            if self.proc.returncode is not None or time.monotonic() > deadline:
                raise SandboxError(f"firecracker did not start: {self.failure()}")
            await asyncio.sleep(0.02)

    async def _api_accepts(self) -> bool:
        try:
            _, writer = await unix_connect(self.api_sock)
        except OSError:  # not there yet, or there and not yet listening (ECONNREFUSED)
            return False
        writer.close()
        return True

    async def call(self, method: str, path: str, body: Optional[dict] = None,
                   timeout: float = API_TIMEOUT) -> Optional[dict]:
        try:
            return await api_call(self.api_sock, method, path, body, timeout)
        except SandboxError as e:
            if self.proc and self.proc.returncode is None:  # a vanished API often means a dying process
                try:
                    await asyncio.wait_for(asyncio.shield(self.proc.wait()), 0.5)
                except asyncio.TimeoutError:
                    pass
            raise SandboxError(str(e) if self.running else f"{e} ({self.failure()})") from None

    async def connect_agent(self, timeout: float) -> None:
        """Connect to the agent through the vsock socket; until the guest
        listens, Firecracker closes the connection instead of answering OK."""
        deadline = time.monotonic() + timeout
        delay = 0.05
        while True:
            if not self.running:
                raise SandboxError(f"the VM stopped before its agent answered: {self.failure()}")
            try:
                reader, writer = await unix_connect(self.root / VSOCK)
                writer.write(f"CONNECT {AGENT_PORT}\n".encode())
                await writer.drain()
                line = await asyncio.wait_for(reader.readline(), 2)
                if line.startswith(b"OK "):
                    self.reader, self.writer = reader, writer
                    return
                writer.close()
            except (OSError, asyncio.TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise SandboxError(f"the agent did not accept on vsock port {AGENT_PORT} within "
                                   f"{timeout:g} s: {self.failure()}")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)

    # -- lifecycle ------------------------------------------------------
    async def boot(self) -> None:
        from sandgate_images import vmlinux

        loop = asyncio.get_running_loop()
        image = await loop.run_in_executor(None, self.driver.image)
        agent = await loop.run_in_executor(None, self.driver.agent_disk)
        kernel = image / KERNEL
        if (image / "vmlinuz").exists():
            kernel = await loop.run_in_executor(None, vmlinux.extract, image / "vmlinuz")
        self.prepare()
        disk = self.spec.workspace / WORKSPACE
        if not disk.exists():  # first start; a cold restart keeps the disk and its files
            seed = self.spec.workspace_seed and self.spec.workspace_seed / WORKSPACE
            await loop.run_in_executor(None, sparse_copy, seed if seed and seed.is_file() else
                                       image / "workspace.ext4", disk)
        for src, name in ((kernel, KERNEL), (image / INITRD, INITRD), (image / ROOT, ROOT), (agent, AGENT)):
            self.place(src, name)
        self.place_workspace()
        lim = self.spec.limits
        await self.launch()
        await self.call("PUT", "/boot-source", {"kernel_image_path": KERNEL, "initrd_path": INITRD,
                                                "boot_args": BOOT_ARGS})
        # Root first and the others in this order: the guest sees vda, vdb, vdc.
        for drive_id, path, ro in (("root", ROOT, True), ("agent", AGENT, True), ("workspace", WORKSPACE, False)):
            await self.call("PUT", f"/drives/{drive_id}", {"drive_id": drive_id, "path_on_host": path,
                                                          "is_root_device": drive_id == "root", "is_read_only": ro})
        # Dirty-page tracking from boot, so that a checkpoint after a restore can be a Diff.
        await self.call("PUT", "/machine-config", {"vcpu_count": max(1, min(32, int(lim.cpus))),
                                                   "mem_size_mib": lim.memory_mb, "track_dirty_pages": True})
        await self.call("PUT", "/vsock", {"guest_cid": GUEST_CID, "uds_path": VSOCK})
        await self.call("PUT", "/actions", {"action_type": "InstanceStart"})
        (self.spec.state_dir / "disks.json").write_text(json.dumps({ROOT: str(image / ROOT), AGENT: str(agent)}))
        await self.connect_agent(BOOT_TIMEOUT)

    async def load(self, image_dir: Path, consume: bool) -> None:
        manifest = json.loads((image_dir / MANIFEST).read_text())
        self.prepare()
        for name, src in manifest["disks"].items():  # the very disks the snapshot was taken with
            if not Path(src).exists():
                raise SandboxError(f"the checkpoint needs {src}, which is gone (the VM image was rebuilt?)")
            self.place(Path(src), name)
        disk = self.spec.workspace / WORKSPACE
        disk.unlink(missing_ok=True)
        if consume:
            move(image_dir / WORKSPACE, disk)
            for name in (VMSTATE, MEM):
                move(image_dir / name, self.root / name)
        else:  # each fork writes its own disk; the memory file is only ever read (MAP_PRIVATE)
            await asyncio.get_running_loop().run_in_executor(None, sparse_copy, image_dir / WORKSPACE, disk)
            for name in (VMSTATE, MEM):
                self.place(image_dir / name, name)
        self.place_workspace()
        (self.spec.state_dir / "disks.json").write_text(json.dumps(manifest["disks"]))
        await self.launch()
        # The load clears the dirty bitmap: a Diff snapshot later holds what changed since.
        # enable_diff_snapshots, not its newer name track_dirty_pages: every release takes it.
        await self.call("PUT", "/snapshot/load", {"snapshot_path": VMSTATE, "mem_backend": {
            "backend_type": "File", "backend_path": MEM}, "enable_diff_snapshots": True, "resume_vm": False},
            timeout=SNAPSHOT_TIMEOUT)
        await self.call("PATCH", "/vm", {"state": "Resumed"})
        # The snapshot reset the guest's vsock connections; the agent still listens.
        await self.connect_agent(30)

    async def stop(self) -> None:
        self.console.close()
        if self.proc and self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()

    def failure(self) -> str:
        code = self.proc.returncode if self.proc else None
        if code is None:
            what = "VM is running"
        elif code in (-9, 137):
            what = f"VM was killed (exit status {code}, SIGKILL)"
        else:
            what = f"VM exited with status {code}"
        lines = self.console.lines()
        panic = [ln for ln in lines if "Kernel panic" in ln or "sandgate-init" in ln]
        errors = [ln for ln in lines if "rror" in ln and ln not in panic]
        tail = (panic[-2:] + (errors or lines)[-2:])[-4:]
        return what + (": " + " | ".join(tail) if tail else "")

    async def destroy(self) -> None:
        await self.stop()
        if self.writer:
            self.writer.close()
        shutil.rmtree(self.spec.state_dir, ignore_errors=True)
        if self.jail_top:
            shutil.rmtree(self.jail_top, ignore_errors=True)
        self.driver.unregister(self)


class FirecrackerDriver(Driver):
    name = "firecracker"
    can_checkpoint = True
    sync_before_checkpoint = True
    env_at_boot = False  # the guest boots from a shared image: the core sends env in `setup`
    shares_workspace = False  # its workspace is a qcow2/raw disk kept in the workspace directory
    layered_checkpoints = True  # its disks and memory files are shared with what is restored from them

    def __init__(self, root_dir: str, settings: "Settings"):
        self.root_dir = Path(root_dir)  # the registry of running VMs, for reap()
        self.home = self.root_dir.parents[1]
        self.settings = settings
        self.uid = settings.firecracker_uid
        self.gid = self.uid if settings.firecracker_gid is None else settings.firecracker_gid

    @classmethod
    def probe(cls, settings: "Settings") -> Tuple[bool, str]:
        fc = firecracker_path(settings.firecracker_bin)
        if not fc:
            return False, "firecracker not found (set FIRECRACKER_BIN or put firecracker on PATH)"
        if not (os.path.isfile(fc) and os.access(fc, os.X_OK)):
            return False, f"FIRECRACKER_BIN={fc} is not an executable file"
        if not os.path.exists("/dev/kvm"):
            return False, "no /dev/kvm: Firecracker needs KVM"
        jailer = jailer_path(settings.firecracker_jailer)
        if jailer and not (os.path.isfile(jailer) and os.access(jailer, os.X_OK)):
            return False, f"SANDGATE_FIRECRACKER_JAILER={jailer} is not an executable file"
        return True, f"firecracker at {fc}" + (f", jailed by {jailer}" if jailer else "")

    def image(self) -> Path:
        """The VM image: SANDGATE_FIRECRACKER_IMAGE (a directory laid out like
        images/vm.py's) or the one images/vm.py builds."""
        if self.settings.firecracker_image:
            d = Path(self.settings.firecracker_image)
        else:
            from sandgate_images import vm

            try:
                d = vm.build(self.home)
            except RuntimeError as e:
                raise SandboxError(f"cannot build the VM image: {e}") from None
        missing = [n for n in (INITRD, ROOT, "workspace.ext4") if not (d / n).exists()]
        if not ((d / "vmlinuz").exists() or (d / KERNEL).exists()):
            missing.insert(0, "vmlinuz")
        if missing:
            raise SandboxError(f"the VM image {d} lacks {', '.join(missing)}")
        return d

    def agent_disk(self) -> Path:
        from sandgate_images import vm

        try:
            return vm.agent_disk(self.home)
        except RuntimeError as e:
            raise SandboxError(f"cannot build the agent disk: {e}") from None

    # -- registry: VMs outlive a killed gateway (own session), reap() ends them
    def register(self, sb: FirecrackerSandbox) -> None:
        self.root_dir.mkdir(parents=True, exist_ok=True)
        entry = {"pid": sb.proc.pid if sb.proc else None, "state_dir": str(sb.spec.state_dir),
                 "jail": str(sb.jail_top) if sb.jail_top else None}
        tmp = self.root_dir / f".{sb.id}.tmp"  # a gateway killed mid-write leaves no half entry
        tmp.write_text(json.dumps(entry))
        os.replace(tmp, self.root_dir / f"{sb.id}.json")

    def unregister(self, sb: Sandbox) -> None:
        (self.root_dir / f"{sb.id}.json").unlink(missing_ok=True)

    async def reap(self, keep=()) -> int:
        n = 0  # nothing is kept: this driver does not adopt (Driver.adopt)
        for entry in self.root_dir.glob("*.json") if self.root_dir.is_dir() else []:
            try:
                info = json.loads(entry.read_text())
            except (OSError, ValueError):
                info = {}
            try:
                pid = info.get("pid")
                # only a process that is still this VM's Firecracker (pids get reused)
                if pid and entry.stem.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.kill(pid, signal.SIGKILL)
                    n += 1
            except OSError:
                pass
            for d in (info.get("state_dir"), info.get("jail")):
                if d:
                    shutil.rmtree(d, ignore_errors=True)
            entry.unlink(missing_ok=True)
        return n

    async def create(self, spec: SandboxSpec) -> Sandbox:
        sb = FirecrackerSandbox(spec, self)
        try:
            await sb.boot()
        except (OSError, RuntimeError) as e:
            await sb.destroy()
            raise SandboxError(f"could not start the VM: {e}") from None
        except BaseException:
            await sb.destroy()
            raise
        return sb

    async def checkpoint(self, sandbox: Sandbox, image_dir: Path) -> None:
        """Pause, snapshot, stop; then the snapshot and the workspace disk go
        into image_dir. A VM restored from a snapshot still has the memory
        file it loaded: its snapshot is a Diff (only the pages written since
        the load), applied onto a copy of that file, or onto the file itself
        when nothing else links to it (a resumed pause). A booted VM takes a
        Full one. Until the VM is stopped a failure resumes it. The snapshot
        resets the guest's vsock connections, so after a failed
        snapshot/create the resumed VM gets a new agent stream:
        sandbox.reader/writer are replaced and the old stream is closed."""
        assert isinstance(sandbox, FirecrackerSandbox)
        sb = sandbox
        if not sb.running:
            raise SandboxError(f"cannot checkpoint a stopped VM: {sb.failure()}")
        kind = "Diff" if (sb.root / MEM).exists() else "Full"
        # The memory file is as big as guest memory; a Diff may need a copy of the loaded one beside it.
        copies = 2 if kind == "Diff" and sb.shares_memory() else 1
        require_disk_for_checkpoint(sb.root, (sb.spec.limits.memory_mb * copies + 64) << 20)
        try:
            await sb.call("PATCH", "/vm", {"state": "Paused"})
        except SandboxError as e:
            await self._resume(sb, reconnect=False)
            raise SandboxError(f"checkpoint failed, the VM runs on: {e}") from None
        try:
            await sb.call("PUT", "/snapshot/create", {"snapshot_type": kind, "snapshot_path": NEW_VMSTATE,
                                                      "mem_file_path": NEW_MEM}, timeout=SNAPSHOT_TIMEOUT)
        except SandboxError as e:
            for name in (NEW_VMSTATE, NEW_MEM):
                (sb.root / name).unlink(missing_ok=True)
            await self._resume(sb, reconnect=True)
            raise SandboxError(f"checkpoint failed, the VM runs on: {e}") from None
        await sb.stop()
        image_dir.mkdir(parents=True, exist_ok=True)
        disk = sb.workspace_disk()
        try:
            disks = json.loads((sb.spec.state_dir / "disks.json").read_text())
            written = (await asyncio.get_running_loop().run_in_executor(None, self._full_memory, sb)
                       if kind == "Diff" else None)
            (image_dir / MANIFEST).write_text(json.dumps({
                "format": 1, "snapshot_type": kind, "diff_bytes": written, "disks": disks,
                "jailed": bool(sb.jailer), "mem_size_mib": sb.spec.limits.memory_mb, "created": time.time()},
                indent=1))
            for src, name in ((NEW_VMSTATE, VMSTATE), (NEW_MEM, MEM)):
                move(sb.root / src, image_dir / name)
                os.chmod(image_dir / name, 0o444)  # shared by every restore of this checkpoint: never written
            move(disk, image_dir / WORKSPACE)
            (sb.spec.workspace / WORKSPACE).unlink(missing_ok=True)  # the other name of a hard link
        except (OSError, ValueError) as e:
            if (image_dir / WORKSPACE).exists() and not disk.exists():
                move(image_dir / WORKSPACE, disk)  # the workspace disk is never lost with the checkpoint
            raise SandboxError(f"checkpoint failed after the VM stopped: {e}") from None

    @staticmethod
    def _full_memory(sb: FirecrackerSandbox) -> int:
        """Turn the Diff in NEW_MEM into a full memory file under the same
        name: the loaded memory plus the diff's pages. The loaded file is
        written in place only if it is this VM's alone (a resumed pause moved
        it here); one shared with a checkpoint (a hard link or symlink to it)
        is copied first, since that checkpoint must never change."""
        base, diff, full = sb.root / MEM, sb.root / NEW_MEM, sb.root / "snapshot.full"
        if sb.shares_memory():
            sparse_copy(base, full)
        else:
            os.replace(base, full)
        os.chmod(full, 0o644)
        written = apply_diff(diff, full)
        os.replace(full, diff)
        return written

    async def _resume(self, sb: FirecrackerSandbox, reconnect: bool) -> None:
        try:
            await sb.call("PATCH", "/vm", {"state": "Resumed"})
            if reconnect:
                old = sb.writer
                await sb.connect_agent(30)
                if old:
                    old.close()
        except SandboxError as e:
            await sb.stop()  # neither paused forever nor unreachable
            raise SandboxError(f"checkpoint failed and the VM could not be resumed, so it was stopped: {e}") from None

    async def freeze(self, sandbox: Sandbox) -> None:
        assert isinstance(sandbox, FirecrackerSandbox)
        await sandbox.call("PATCH", "/vm", {"state": "Paused"})

    async def thaw(self, sandbox: Sandbox) -> None:
        assert isinstance(sandbox, FirecrackerSandbox)
        await sandbox.call("PATCH", "/vm", {"state": "Resumed"})

    async def restore(self, spec: SandboxSpec, image_dir: Path, consume: bool = False) -> Sandbox:
        missing = [n for n in (MANIFEST, VMSTATE, MEM, WORKSPACE) if not (image_dir / n).exists()]
        if missing:
            raise SandboxError(f"not a Firecracker checkpoint: {image_dir} lacks {', '.join(missing)}")
        sb = FirecrackerSandbox(spec, self)
        try:
            await sb.load(image_dir, consume)
        except BaseException as e:
            await sb.stop()
            disk = spec.workspace / WORKSPACE
            if consume:  # put back what was taken, so the image is whole for another try
                for src, name in ((disk, WORKSPACE), (sb.root / VMSTATE, VMSTATE), (sb.root / MEM, MEM)):
                    if src.exists() and not (image_dir / name).exists():
                        move(src, image_dir / name)
            disk.unlink(missing_ok=True)
            await sb.destroy()
            if isinstance(e, (OSError, RuntimeError, ValueError, KeyError)):
                raise SandboxError(f"could not restore the VM: {e}") from None
            raise
        return sb
