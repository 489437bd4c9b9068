"""MicroVM boot artifacts, made from Debian packages and the same root
filesystem as the gVisor image (rootfs.py):

* ``vmlinuz``: the Debian cloud kernel (linux-image-cloud-amd64);
* ``initrd.gz``: busybox (busybox-static) plus the virtio modules the cloud
  kernel ships as modules; its /init mounts the disks and executes the guest
  agent as PID 1 on the virtio-serial port named ``sandgate``, with user
  namespaces turned off and no_new_privs set;
* ``root.ext4``: the root filesystem as a raw ext4 image, the read-only base
  every VM's qcow2 root overlay sits on;
* ``workspace.ext4``: an empty ext4 filesystem, the base of every VM's
  workspace overlay (so a workspace disk costs only what is written to it).

Named by a hash of this recipe and the root filesystem's image name, built in
a temporary directory and renamed into place when complete.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import uuid
from pathlib import Path
from typing import Callable

from . import rootfs

RECIPE = {
    "version": 2,
    "kernel_package": "linux-image-cloud-amd64",
    # Load order matters: each needs the ones before it.
    "modules": ["drivers/virtio/virtio_ring.ko", "drivers/virtio/virtio.ko", "drivers/virtio/virtio_mmio.ko",
                "drivers/block/virtio_blk.ko", "drivers/char/virtio_console.ko",
                # AF_VSOCK, for hosts with vhost-vsock (qemu) and for Firecracker
                "net/vmw_vsock/vsock.ko", "net/vmw_vsock/vmw_vsock_virtio_transport_common.ko",
                "net/vmw_vsock/vmw_vsock_virtio_transport.ko"],
    "root_size": "3G",
    "workspace_size": "1G",
}

INIT = """#!/bin/busybox sh
# sandgate microVM init: disks are vda (root, read-only), vdb (agent), vdc (workspace).
# Kernel command line: sandgate.transport=serial:/dev/sandgate (default) or vsock:PORT;
# sandgate.probe=1 only proves the guest reaches userspace (the KVM trial boot).
B=/bin/busybox
$B mount -t proc proc /proc; $B mount -t sysfs sys /sys; $B mount -t devtmpfs dev /dev
T=serial:/dev/sandgate
for a in $($B cat /proc/cmdline); do
  case "$a" in sandgate.transport=*) T="${{a#*=}}";; sandgate.probe=1) echo sandgate-probe-ok >/dev/ttyS0; $B poweroff -f;; esac
done
{insmods}
# No user namespaces in the guest, for anyone: in one, the kernel's uid 1000 would hold every
# capability over what the namespace owns, and the guest kernel's namespace code is attack surface.
echo 0 >/proc/sys/user/max_user_namespaces || echo "sandgate-init: cannot turn off user namespaces" >/dev/ttyS0
$B mount -o ro /dev/vda /newroot || {{ echo "sandgate-init: cannot mount the root disk" >/dev/ttyS0; $B poweroff -f; }}
$B mount -t tmpfs -o mode=1777 tmpfs /newroot/tmp
$B mount -o ro /dev/vdb /newroot/opt/sandgate || echo "sandgate-init: cannot mount the agent disk" >/dev/ttyS0
$B mount /dev/vdc /newroot/workspace && $B chown 1000:1000 /newroot/workspace
for p in /sys/class/virtio-ports/*; do
  [ "$($B cat $p/name)" = sandgate ] && $B ln -sf /dev/$($B basename $p) /dev/sandgate
done
$B mount --move /dev /newroot/dev; $B mount --move /proc /newroot/proc; $B mount --move /sys /newroot/sys
# no_new_privs from here on, inherited by the agent and everything it starts: no setuid or
# file-capability binary raises the kernel's (uid 1000) privileges.
exec $B switch_root /newroot /usr/bin/setpriv --no-new-privs /usr/bin/env -i PATH=/usr/local/bin:/usr/bin:/bin HOME=/workspace LANG=C.UTF-8 \\
  PYTHONPATH=/opt/sandgate PYTHONDONTWRITEBYTECODE=1 MPLCONFIGDIR=/tmp/matplotlib PYDEVD_DISABLE_FILE_VALIDATION=1 \\
  /usr/bin/python3 -m sandgate_agent.agent --transport "$T" --workspace /workspace \\
  --runtime-dir /tmp/sandgate --user 1000
"""


def vm_dir(home: Path) -> Path:
    base = rootfs.image_dir(home).name
    h = hashlib.sha256(json.dumps({"recipe": RECIPE, "init": INIT, "rootfs": base}, sort_keys=True).encode())
    return home / "images" / f"vm-{h.hexdigest()[:16]}"


def is_built(home: Path) -> bool:
    return (vm_dir(home) / "manifest.json").exists()


def _run(cmd, **kw) -> str:
    p = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if p.returncode != 0:
        raise RuntimeError(f"{cmd[0]} failed: {(p.stderr or p.stdout).strip()[-400:]}")
    return p.stdout


# Sandboxes start in executor threads: two first starts must not build the same files at once.
_LOCK = threading.Lock()


def build(home: Path, progress: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True)) -> Path:
    final = vm_dir(home)
    if (final / "manifest.json").exists():
        return final
    with _LOCK:
        if (final / "manifest.json").exists():
            return final
        return _build(home, final, progress)


def _build(home: Path, final: Path, progress: Callable[[str], None]) -> Path:
    base = rootfs.build(home, progress=progress) / "rootfs"
    for tool in ("apt-get", "dpkg-deb", "mkfs.ext4", "qemu-img"):
        if not shutil.which(tool):
            raise RuntimeError(f"{tool} not found (apt-get install e2fsprogs qemu-utils)")
    tmp = Path(tempfile.mkdtemp(prefix=final.name + ".building-", dir=final.parent))
    try:
        progress("building the microVM kernel, initramfs and root disk")
        dl = tmp / "debs"
        dl.mkdir()
        deps = _run(["apt-cache", "depends", RECIPE["kernel_package"]])
        kernel_pkg = next(line.split()[-1] for line in deps.splitlines() if "Depends: linux-image-" in line)
        _run(["apt-get", "download", kernel_pkg, "busybox-static"], cwd=dl)
        for deb in dl.glob("*.deb"):
            _run(["dpkg-deb", "-x", str(deb), str(tmp / "x")])
        vmlinuz = next((tmp / "x" / "boot").glob("vmlinuz-*"))
        shutil.copy(vmlinuz, tmp / "vmlinuz")
        moddir = next((tmp / "x" / "lib" / "modules").iterdir()) / "kernel"
        ird = tmp / "initrd"
        for d in ("bin", "mods", "newroot", "proc", "sys", "dev"):
            (ird / d).mkdir(parents=True)
        shutil.copy(tmp / "x" / "bin" / "busybox", ird / "bin" / "busybox")
        names = []
        for rel in RECIPE["modules"]:
            shutil.copy(moddir / rel, ird / "mods" / Path(rel).name)
            names.append(f"$B insmod /mods/{Path(rel).name}")
        (ird / "init").write_text(INIT.format(insmods="\n".join(names)))
        os.chmod(ird / "init", 0o755)
        files = "\n".join(sorted(os.path.relpath(p, ird) for p in glob.glob(f"{ird}/**", recursive=True)))
        cpio = subprocess.run([str(ird / "bin" / "busybox"), "cpio", "-o", "-H", "newc"], input=files.encode(),
                              cwd=ird, capture_output=True, check=True).stdout
        subprocess.run(["gzip", "-1"], input=cpio, stdout=open(tmp / "initrd.gz", "wb"), check=True)
        progress("  writing the ext4 root disk (about 20 s)")
        _run(["truncate", "-s", RECIPE["root_size"], str(tmp / "root.ext4")])
        _run(["mkfs.ext4", "-q", "-F", "-d", str(base), str(tmp / "root.ext4")])
        _run(["truncate", "-s", RECIPE["workspace_size"], str(tmp / "workspace.ext4")])
        _run(["mkfs.ext4", "-q", "-F", "-E", "root_owner=1000:1000", str(tmp / "workspace.ext4")])
        shutil.rmtree(tmp / "x")
        shutil.rmtree(dl)
        shutil.rmtree(ird)
        (tmp / "manifest.json").write_text(json.dumps({"kernel": kernel_pkg, "recipe": RECIPE}))
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "manifest.json").exists():  # else another process built it meanwhile
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    progress(f"microVM image {final.name} built")
    return final


def agent_disk(home: Path) -> Path:
    """The guest agent bundle as a small read-only ext4 disk, per agent hash."""
    bundle = rootfs.agent_bundle(home)
    disk = bundle / "agent.ext4"
    with _LOCK:
        if disk.exists():
            return disk
        tmp = disk.with_suffix(f".tmp-{uuid.uuid4().hex}")
        src = tempfile.mkdtemp()
        try:
            shutil.copytree(bundle / "sandgate_agent", Path(src) / "sandgate_agent")
            _run(["truncate", "-s", "16M", str(tmp)])
            _run(["mkfs.ext4", "-q", "-F", "-d", src, str(tmp)])
            os.rename(tmp, disk)
        finally:
            shutil.rmtree(src, ignore_errors=True)
            tmp.unlink(missing_ok=True)
    return disk
