"""A sandbox's workspace on the host: its one writable, persistent place, with
a real size limit.

As root, a workspace is a sparse file ``<root>/<id>.img`` formatted ext4 and
loop-mounted at ``<root>/<id>/`` with ``nosuid,nodev``: writing past its size
fails with ENOSPC inside the sandbox and the host's disk holds at most the
image; ``statvfs`` inside shows the image's size; a setuid file left there is
inert on the host. ``<root>`` is 0700 root, so no host user reaches the files
but root. The image holds the data; the mount is only how the host (the
driver's bind mount, checkpoints) reads it, so ``detach`` and ``attach`` take
it down and up again across gateway restarts.

Not root (rootless runsc): a plain directory with no limit, and
``Workspace.quota`` is False (logged once).

The files inside belong to ``sandbox_uid()``: a host uid no account or group
has, so a file a sandbox leaves behind grants no real user anything.
"""

from __future__ import annotations

import asyncio
import functools
import grp
import logging
import os
import pwd
import shutil
import uuid
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

log = logging.getLogger("sandgate.workspace")

# systemd's UID map (docs/UIDS-GIDS.md) leaves 60514..61183 unused: above
# systemd-homed's 60001..60513, below DynamicUser's 61184..65519, inside
# Debian's 60000..64999 that is only allocated on demand, far from adduser's
# 1000..59999 and from nobody (65534). The first uid going down from 61183 that
# is neither a user nor a group (looked up through NSS) is the sandbox uid.
UID_RANGE = range(61183, 60513, -1)
MIN_MB = 16  # smaller ext4 file systems with a journal are not worth having
MOUNT_OPTIONS = "loop,nosuid,nodev,noatime,discard"  # discard: deleted files free the host's disk again

_uid: Optional[int] = None
_warned = False


class WorkspaceError(Exception):
    """A workspace could not be created, mounted or removed; the message says why."""


def unused_id(uid: int) -> bool:
    """Neither a user's nor a group's (through NSS, as ls and ps would see it)."""
    for lookup in (pwd.getpwuid, grp.getgrgid):
        try:
            lookup(uid)
            return False
        except KeyError:
            pass
    return True


def choose_sandbox_uid(configured: Optional[int] = None) -> int:
    """Fix this process's sandbox uid (at start): configured, the sandbox_uid setting (refused if
    an account has it), or else the first unused uid in ``UID_RANGE``."""
    global _uid
    if configured is not None:
        if not 0 < configured < 0xFFFFFFFF or not unused_id(configured):
            raise WorkspaceError(f"sandbox_uid (SANDGATE_SANDBOX_UID) {configured} belongs to a user or group of "
                                 "this host (or is out of range): sandboxes need a uid nobody has")
        _uid = configured
        return _uid
    uid = next((u for u in UID_RANGE if unused_id(u)), None)
    if uid is None:
        raise WorkspaceError(f"every uid in {UID_RANGE.stop + 1}..{UID_RANGE.start} belongs to a user or "
                             "group: set SANDGATE_SANDBOX_UID to one that nobody has")
    _uid = uid
    return _uid


def sandbox_uid() -> int:
    """The host uid (and gid) of everything a sandbox writes: one that no user
    and no group has, the one choose_sandbox_uid fixed (else chosen at the first
    call, as it would). It stays the same across restarts unless an account is
    created with it meanwhile."""
    return _uid if _uid is not None else choose_sandbox_uid()


@functools.lru_cache(maxsize=None)
def quota_supported() -> Tuple[bool, str]:
    """Whether workspaces can be size-limited disk images here, and why not."""
    if os.geteuid() != 0:
        return False, "the gateway is not root"
    missing = [t for t in ("mkfs.ext4", "mount", "umount") if not shutil.which(t)]
    if missing:
        return False, f"{', '.join(missing)} not found"
    if not os.path.exists("/dev/loop-control"):
        return False, "no loop devices (/dev/loop-control is missing)"
    return True, "ext4 images on loop devices"


def _mounts() -> List[Tuple[str, str]]:
    """(mount point, source) of every mount this process sees, innermost last."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            sep = fields.index("-")
            out.append((_unescape(fields[4]), _unescape(fields[sep + 2])))
    return out


def _unescape(s: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo
    return s.encode().decode("unicode_escape").encode("latin-1").decode() if "\\" in s else s


def _mounted(path: Path) -> bool:
    p = os.path.realpath(path)  # mountinfo names the real path
    return any(target == p for target, _ in _mounts())


async def _run(*argv: str, check: bool = True) -> Tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.DEVNULL,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await proc.communicate()
    text = out.decode(errors="replace").strip()
    if check and proc.returncode != 0:
        raise WorkspaceError(f"{' '.join(argv[:2])} failed (status {proc.returncode}): {text[-400:]}")
    return proc.returncode, text


async def _umount(path: Path) -> None:
    """Unmount; if something on the host still uses it (a snapshot walking it),
    detach it lazily: the loop device goes when the last user does."""
    code, out = await _run("umount", str(path), check=False)
    if code != 0 and _mounted(path):
        log.warning("umount %s: %s; detaching lazily", path, out)
        await _run("umount", "-l", str(path))


class Workspace:
    """One sandbox's workspace: ``path`` is the directory the driver mounts at
    /workspace (with a quota, a mount point of its own)."""

    def __init__(self, root: Path, sandbox_id: str, size_mb: int, uid: int, disk: bool = True):
        """``disk=False``: a plain directory whatever the host supports (a VM's
        workspace is a disk image of its own, kept in this directory)."""
        if not sandbox_id or "/" in sandbox_id or sandbox_id.startswith("."):
            raise WorkspaceError(f"bad workspace id {sandbox_id!r}")
        self.root = Path(root)
        self.id = sandbox_id
        self.size_mb = size_mb
        self.uid = uid
        self.quota, why = quota_supported() if disk else (False, "")
        if not self.quota and disk:
            global _warned
            if not _warned:
                _warned = True
                log.warning("workspaces have no size limit: %s (each is a plain directory)", why)
        elif size_mb < MIN_MB:
            raise WorkspaceError(f"a workspace needs at least {MIN_MB} MB, not {size_mb}")
        self._lock = asyncio.Lock()

    def __repr__(self) -> str:
        return f"Workspace({self.path}, {self.size_mb} MB{'' if self.quota else ', no quota'})"

    @property
    def path(self) -> Path:
        return self.root / self.id

    @property
    def image(self) -> Path:
        return self.root / f"{self.id}.img"

    @property
    def mounted(self) -> bool:
        return _mounted(self.path)

    def _prepare_root(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        if self.quota:
            os.chown(self.root, 0, 0)
            os.chmod(self.root, 0o700)

    async def create(self) -> None:
        """An empty workspace of ``size_mb``; a second call changes nothing."""
        async with self._lock:
            self._prepare_root()
            if not self.quota:
                self.path.mkdir(exist_ok=True)
                return
            if self.mounted:
                return
            if self.image.exists():
                await self._mount()
                return
            if self.path.is_dir() and any(self.path.iterdir()):
                raise WorkspaceError(f"{self.path} already holds files that are not in a workspace image")
            tmp = self.root / f".{self.id}.img.{uuid.uuid4().hex[:8]}"
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    os.ftruncate(fd, self.size_mb << 20)  # sparse: the host pays for what is written
                finally:
                    os.close(fd)
                # -m 0: no blocks reserved for root (the sandbox user is never root);
                # a small journal, so statvfs inside is close to size_mb; lazy init
                # (on a sparse file mkfs punches holes, so nothing is left to zero).
                journal = max(4, min(64, self.size_mb // 64))
                await _run("mkfs.ext4", "-q", "-F", "-m", "0", "-T", "default", "-J", f"size={journal}",
                           "-E", f"lazy_itable_init=1,lazy_journal_init=1,root_owner={self.uid}:{self.uid}",
                           "-L", "sandgate-ws", str(tmp))
                os.replace(tmp, self.image)  # an image exists only once it is formatted
            finally:
                tmp.unlink(missing_ok=True)
            await self._mount()
            try:
                (self.path / "lost+found").rmdir()  # e2fsck makes it again if it ever needs one
            except OSError:
                pass
            os.chmod(self.path, 0o700)  # the sandbox user owns it; nobody else needs in

    async def attach(self) -> None:
        """Mount the existing image again (after a gateway restart or a reboot);
        nothing if it is mounted already."""
        async with self._lock:
            self._prepare_root()
            if not self.quota:
                if not self.path.is_dir():
                    raise WorkspaceError(f"workspace {self.path} is missing")
                return
            if self.mounted:
                return
            if not self.image.is_file():
                raise WorkspaceError(f"workspace image {self.image} is missing")
            await self._mount()

    async def _mount(self) -> None:
        self.path.mkdir(mode=0o700, exist_ok=True)
        await _run("mount", "-t", "ext4", "-o", MOUNT_OPTIONS, str(self.image), str(self.path))

    async def detach(self) -> None:
        """Unmount and keep the image (the gateway exits)."""
        async with self._lock:
            if self.quota and self.mounted:
                await _umount(self.path)

    async def delete(self) -> None:
        """Unmount and remove the image and the directory; the loop device goes
        with the last mount (mount's autoclear)."""
        async with self._lock:
            if not self.quota:
                await asyncio.to_thread(shutil.rmtree, self.path, True)
                return
            for _ in range(8):  # mounted twice over counts too
                if not self.mounted:
                    break
                await _umount(self.path)
            self.image.unlink(missing_ok=True)
            if self.path.is_dir():
                try:
                    self.path.rmdir()
                except OSError:  # files that never were in the image: remove them too
                    await asyncio.to_thread(shutil.rmtree, self.path, True)

    async def rename(self, new_id: str) -> None:
        """Give the workspace another id (a pooled sandbox taking the user's).
        A running sandbox keeps its own mount of it and notices nothing."""
        new = Workspace(self.root, new_id, self.size_mb, self.uid, disk=self.quota)
        async with self._lock:
            if new.path.exists() or new.image.exists():
                raise WorkspaceError(f"workspace {new_id} exists already")
            if not self.quota:
                os.rename(self.path, new.path)
            elif self.mounted:
                # A mount point cannot be renamed and, under a shared parent, not
                # moved either: bind it at the new place, then let go of the old.
                new.path.mkdir(mode=0o700)
                try:
                    await _run("mount", "--bind", str(self.path), str(new.path))
                except WorkspaceError:
                    new.path.rmdir()
                    raise
                os.rename(self.image, new.image)  # the loop device follows the file
                await _umount(self.path)
                self.path.rmdir()
            else:
                os.rename(self.image, new.image)
                if self.path.is_dir():
                    os.rename(self.path, new.path)
            self.id = new_id

    def usage(self) -> Dict[str, object]:
        """``size_bytes`` (what statvfs shows: the file system's size) and
        ``used_bytes``. Unmounted: the image's nominal and allocated sizes.
        Without a quota ``size_bytes`` is ``size_mb``, not enforced, and
        ``used_bytes`` walks the tree."""
        if self.quota and self.mounted:
            st = os.statvfs(self.path)
            return {"size_bytes": st.f_blocks * st.f_frsize,
                    "used_bytes": (st.f_blocks - st.f_bfree) * st.f_frsize, "quota": True}
        if self.quota:
            try:
                used = os.stat(self.image).st_blocks * 512
            except FileNotFoundError:
                used = 0
            return {"size_bytes": self.size_mb << 20, "used_bytes": used, "quota": True}
        used = 0
        for dirpath, dirnames, filenames in os.walk(self.path):
            for name in filenames + dirnames:
                try:
                    used += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
                except OSError:
                    pass
        return {"size_bytes": self.size_mb << 20, "used_bytes": used, "quota": False}


def _loop_devices() -> List[Tuple[str, str]]:
    """(device, backing file) of every attached loop device."""
    out = []
    for dev in Path("/sys/block").glob("loop*"):
        try:
            backing = (dev / "loop" / "backing_file").read_text().strip()
        except OSError:
            continue
        if backing.endswith(" (deleted)"):
            backing = backing[: -len(" (deleted)")]
        out.append((f"/dev/{dev.name}", backing))
    return out


async def reap_mounts(root: Path, keep: Iterable[str] = ()) -> int:
    """Unmount the workspaces under ``root`` that a previous gateway left
    mounted, and detach loop devices left on their images, except the ids in
    ``keep`` (workspaces that still have a record: ``attach`` those). The
    images stay: removing them is ``Workspace.delete``. Returns how many mounts
    and devices went."""
    root = Path(root).resolve()
    keep = set(keep)
    n = 0
    for target, _ in reversed(_mounts()):
        p = Path(target)
        if p.parent == root and p.name not in keep:
            await _umount(p)
            n += 1
    mounted = {source for _, source in _mounts()}
    for dev, backing in _loop_devices():
        b = Path(backing)
        if b.parent == root and b.suffix == ".img" and b.stem not in keep and dev not in mounted:
            code, _ = await _run("losetup", "-d", dev, check=False)
            n += code == 0
    return n
