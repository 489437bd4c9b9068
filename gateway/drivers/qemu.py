"""QEMU microVM sandboxes: one small VM per sandbox, with its own kernel.

``qemu-system-x86_64 -M microvm`` boots the Debian cloud kernel with the
initramfs from images/vm.py. Disks: the root filesystem as a qcow2 overlay on
the shared read-only base (each VM's root is a delta), the agent bundle
(read-only) and the workspace (an ext4 image kept with the sandbox's
workspace, so it survives a restart). The agent's stream is a virtio-serial
port backed by a unix socket; the VM has no network device at all.

Acceleration is TCG unless SANDGATE_QEMU_ACCEL=kvm: a /dev/kvm that opens can
still hang every stock guest (nested PVM hosts), see docs/drivers.md.
Not yet here: checkpoint/restore (QMP migrate), vsock, KVM detection by trial.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path
from typing import Optional, Tuple

from .base import Driver, ProcessSandbox, Sandbox, SandboxError, SandboxSpec


def qemu_path() -> Optional[str]:
    return shutil.which("qemu-system-x86_64")


class QemuSandbox(ProcessSandbox):
    def __init__(self, spec: SandboxSpec, driver: "QemuDriver"):
        super().__init__(spec)
        self.driver = driver
        self.console = spec.state_dir / "console.log"

    async def start(self) -> None:
        from sandgate_images import vm

        d = self.spec.state_dir
        d.mkdir(parents=True, exist_ok=True)
        self.spec.workspace.mkdir(parents=True, exist_ok=True)
        image = await asyncio.get_running_loop().run_in_executor(None, vm.build, self.driver.home)
        agent = await asyncio.get_running_loop().run_in_executor(None, vm.agent_disk, self.driver.home)
        overlay, sock = d / "root.qcow2", d / "agent.sock"
        ws = self.spec.workspace / "workspace.ext4"
        await self.driver.run("qemu-img", "create", "-q", "-f", "qcow2", "-b", str(image / "root.ext4"),
                              "-F", "raw", str(overlay))
        if not ws.exists():
            await self.driver.run("truncate", "-s", "1G", str(ws))
            await self.driver.run("mkfs.ext4", "-q", "-F", str(ws))
        lim = self.spec.limits
        accel = os.environ.get("SANDGATE_QEMU_ACCEL", "tcg")
        self.proc = await asyncio.create_subprocess_exec(
            qemu_path() or "qemu-system-x86_64", "-M", "microvm", "-accel", accel,
            "-m", str(lim.memory_mb), "-smp", str(max(1, int(lim.cpus))),
            "-nodefaults", "-no-user-config", "-nographic", "-serial", f"file:{self.console}",
            "-kernel", str(image / "vmlinuz"), "-initrd", str(image / "initrd.gz"),
            "-append", "console=ttyS0 quiet panic=-1",
            "-drive", f"id=root,file={overlay},format=qcow2,if=none", "-device", "virtio-blk-device,drive=root",
            "-drive", f"id=agent,file={agent},format=raw,if=none,readonly=on", "-device", "virtio-blk-device,drive=agent",
            "-drive", f"id=ws,file={ws},format=raw,if=none", "-device", "virtio-blk-device,drive=ws",
            "-device", "virtio-serial-device",
            "-chardev", f"socket,id=agentc,path={sock},server=on,wait=off",
            "-device", "virtserialport,chardev=agentc,name=sandgate",
            "-qmp", f"unix:{d / 'qmp.sock'},server=on,wait=off", "-no-reboot",
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
            start_new_session=True)
        for _ in range(200):  # qemu creates the socket within moments of starting
            if sock.exists() or self.proc.returncode is not None:
                break
            await asyncio.sleep(0.05)
        if not sock.exists():
            raise SandboxError(f"qemu did not start: {self.failure()}")
        self.reader, self.writer = await asyncio.open_unix_connection(str(sock), limit=1 << 20)

    def failure(self) -> str:
        code = self.proc.returncode if self.proc else None
        what = "VM is running" if code is None else f"VM exited with status {code}"
        try:
            lines = [ln for ln in self.console.read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            lines = []
        panic = [ln for ln in lines if "Kernel panic" in ln or "sandgate-init" in ln or "Error" in ln]
        tail = (panic or lines)[-3:]
        return what + (": " + " | ".join(tail) if tail else "")

    async def destroy(self) -> None:
        if self.proc and self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()
        if self.writer:
            self.writer.close()
        shutil.rmtree(self.spec.state_dir, ignore_errors=True)


class QemuDriver(Driver):
    name = "qemu"
    can_checkpoint = False

    def __init__(self, root_dir: str):
        self.home = Path(root_dir).parents[1]

    @classmethod
    def probe(cls) -> Tuple[bool, str]:
        path = qemu_path()
        if not path:
            return False, "qemu-system-x86_64 not found (apt-get install qemu-system-x86 qemu-utils)"
        if not (shutil.which("mkfs.ext4") and shutil.which("qemu-img") and shutil.which("apt-get")):
            return False, "needs mkfs.ext4, qemu-img and apt-get to build its image"
        return True, f"qemu at {path} (TCG unless SANDGATE_QEMU_ACCEL=kvm)"

    async def run(self, *cmd: str) -> None:
        p = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE,
                                                 stderr=asyncio.subprocess.STDOUT)
        out, _ = await p.communicate()
        if p.returncode != 0:
            raise SandboxError(f"{cmd[0]} failed: {out.decode(errors='replace').strip()[-300:]}")

    async def create(self, spec: SandboxSpec) -> Sandbox:
        sb = QemuSandbox(spec, self)
        try:
            await sb.start()
        except (OSError, RuntimeError) as e:
            await sb.destroy()
            raise SandboxError(f"could not start the VM: {e}") from None
        except SandboxError:
            await sb.destroy()
            raise
        return sb
