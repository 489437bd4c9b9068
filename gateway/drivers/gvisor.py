"""gVisor sandboxes via runsc: one OCI bundle and one `runsc run` per sandbox.

The agent's stream is the sandbox's stdin/stdout, held by a shim process
(shim.py) that outlives a killed gateway, so the next one adopts the sandbox.
runsc runs detached: it exits once the sandbox is up, and the shim, as the
subreaper, waits on the sandbox itself. The image root is mounted
read-only, the workspace read-write (a plain directory, or a Workspace's ext4
image mounted nosuid,nodev: the gofer follows that mount, and statfs of
/workspace inside passes through to it, so it shows the quota), /tmp is a
tmpfs, there is no network
(`--network=none`, loopback only) and no host path beyond those. Limits go to
the OCI `linux.resources` block, which runsc enforces with cgroups.

The ptrace platform is the default because it runs everywhere, nested VMs
included; `SANDGATE_RUNSC_PLATFORM=systrap|kvm` picks another where it works.

A runsc that has `checkpoint --leave-running` (Debian 13's 0.0~20240729 has,
Debian 12's 0.0~20221219 has not) checkpoints in place: the sandbox is paused,
its image written, its files snapshotted, and it carries on, instead of being
stopped by the checkpoint and restored from it.

A restored Sentry holds ~70 MiB of Go heap left from reading the image until
Go's periodic GC (every 2 minutes, twice: finalizers keep part of it alive
through the first) and its scavenger hand it back, about 4-5 minutes later.
With `SANDGATE_RUNSC_RECLAIM` on, the driver asks for it back at once: runsc
runs with `--profile`, and a moment after a restored sandbox's agent has
answered (after_restore()) the driver requests a heap profile (to a file it
then removes) a few times, each of which runs runtime.GC() in the Sentry.
`--profile` widens the Sentry's seccomp filter by one rule (openat,
read-only), which is why `auto`, the default, leaves it off rootless or with
a newer runsc (reclaim_enabled).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, List, Optional, Tuple

from ..workspace import WorkspaceError, sandbox_uid
from .base import (AdoptedProcess, Driver, ProcessSandbox, Sandbox, SandboxError, SandboxSpec, connect_unix,
                   process_has, require_disk_for_checkpoint, socket_dir, tag, tail_lines)
from ..confine import release
from .shim import remove_cgroups

if TYPE_CHECKING:  # config imports this package (Limits): the settings come in as arguments
    from ..config import Settings

log = logging.getLogger("sandgate.gvisor")

# The kernel and commands run as sandbox_uid() (uid and gid), not root even
# inside the sandbox: a host uid that no account has, since the gofer creates
# workspace files on the host with the sandbox's uid unchanged. It has no
# passwd entry inside either: USER and LOGNAME name it, HOME is /workspace.
SANDBOX_USER = "sandbox"
# CAP_SYS_ADMIN: for the agent's PID namespace and the /proc mounted for it (--pid-namespace).
AGENT_CAPS = ["CAP_SETUID", "CAP_SETGID", "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_KILL", "CAP_SYS_ADMIN"]
BASE_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": "/workspace",
    "LANG": "C.UTF-8",
    "PYTHONPATH": "/opt/sandgate",
    "PYTHONDONTWRITEBYTECODE": "1",
    "MPLCONFIGDIR": "/tmp/matplotlib",
    # IPython's history database lives with the kernel's memory (the tmpfs is in
    # every checkpoint), not in the workspace: a sandbox restored from an older
    # checkpoint over newer files would find its line numbers taken.
    "IPYTHONDIR": "/tmp/ipython",
    "JUPYTER_RUNTIME_DIR": "/tmp/jupyter",
    "PYDEVD_DISABLE_FILE_VALIDATION": "1",  # debugpy's import-time warning is noise here
}


def runsc_path(configured: str = "") -> Optional[str]:
    """The runsc binary: the `runsc` setting, else the one on PATH."""
    return configured or shutil.which("runsc")


DIRECTFS_SINCE = 20230101  # no runsc of 2023 or later is verified for the reclaim (reclaim_enabled)
FREEZE_TIMEOUT = 30  # seconds a freeze or thaw may take before it is refused (a loaded host is slow to stop tasks)
RECLAIM_TIMEOUT = 30  # seconds one runsc call of the reclaim may take (a frozen sandbox does not answer)
# Seconds the reclaim waits after a restored agent answered: its runsc processes would otherwise share
# the CPU with the sandbox's first cell (a fork's first result); longer, and the memory comes back later.
RECLAIM_DEFER = 0.25
RECLAIM_GCS = 3  # measured: one GC frees little (finalizers), three in a row free it all
IN_PLACE_SINCE = 20240729  # the oldest runsc seen to checkpoint in place (see checkpoints_in_place)


def _run_quietly(argv: List[str]) -> str:
    """stdout and stderr of a short command; "" if it cannot run."""
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    return p.stdout + p.stderr


def runsc_error(out: str) -> str:
    """The line that says why, not the tail of a Go stack trace."""
    lines = [line.strip() for line in out.splitlines() if line.strip()]
    for marker in ("panic:", "fatal error:", "error:", "Error:"):
        hit = next((line for line in lines if marker in line), None)
        if hit:
            return hit[:500]
    return (lines[-1] if lines else "no output")[:500]


# Namespaces inside the sandbox are refused to everyone: this runsc lets a process without
# capabilities unshare a mount or cgroup namespace and the sandbox user make a user namespace
# (Linux would not), which puts more of the Sentry within reach and serves nothing here.
# Enforced by the Sentry (runsc --oci-seccomp), so it holds through checkpoint and restore.
# One exception, unshare(CLONE_NEWPID), needs CAP_SYS_ADMIN, which only the agent has: its
# spawner takes it to start the kernel and commands in a PID namespace of their own
# (--pid-namespace), then installs the same refusal, that one included, on itself and so on
# all of them (guest-agent/spawner.py).
CLONE_NEW = {"CLONE_NEWNS": 0x00020000, "CLONE_NEWCGROUP": 0x02000000, "CLONE_NEWUTS": 0x04000000,
             "CLONE_NEWIPC": 0x08000000, "CLONE_NEWUSER": 0x10000000, "CLONE_NEWPID": 0x20000000,
             "CLONE_NEWNET": 0x40000000}
EPERM = 1  # (this runsc answers EPERM whatever errnoRet says: tried with ENOSYS)
# io_uring too: one open io_uring descriptor makes this runsc fail its next checkpoint and
# the sandbox die with it. Programs that try io_uring (libuv, liburing
# users) fall back to ordinary system calls when io_uring_setup fails, as Docker's default
# seccomp profile (EPERM too) has them do.
IO_URING = ["io_uring_setup", "io_uring_enter", "io_uring_register"]


def no_namespaces() -> dict:
    """The sandbox's OCI seccomp filter: no namespaces (but the agent's PID namespace) and no io_uring (EPERM)."""
    deny = {"action": "SCMP_ACT_ERRNO", "errnoRet": EPERM}
    return {
        "defaultAction": "SCMP_ACT_ALLOW",
        "architectures": ["SCMP_ARCH_X86_64"],
        "syscalls": [{"names": ["setns"], **deny}]
        + [{"names": [call], **deny, "args": [{"index": 0, "value": flag, "valueTwo": flag, "op": "SCMP_CMP_MASKED_EQ"}]}
           for call in ("unshare", "clone") for name, flag in CLONE_NEW.items()
           if not (call == "unshare" and name == "CLONE_NEWPID")]
        + [{"names": IO_URING, **deny}],
    }


RUNTIME_ID = re.compile(r"sg-[A-Za-z0-9-]{1,200}")  # what the gateway names runtimes (Sandbox.new_spec, the pool)


def cgroup_name(runtime_id: str) -> str:
    """The runtime's cgroups, under this name in every hierarchy."""
    return f"sandgate/{runtime_id}"


def oci_config(spec: SandboxSpec, argv: List[str]) -> dict:
    env = {**BASE_ENV, "USER": SANDBOX_USER, "LOGNAME": SANDBOX_USER, **spec.env}
    lim = spec.limits
    tmpfs = ["nosuid", "nodev", "mode=1777"]
    return {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            # The agent is root inside the sandbox with only the capabilities it
            # needs to run the kernel as sandbox_uid() and keep the workspace
            # files owned by it; the kernel and commands hold none.
            "user": {"uid": 0, "gid": 0},
            "args": argv,
            "env": [f"{k}={v}" for k, v in env.items()],
            "cwd": "/workspace",
            "capabilities": {**{k: AGENT_CAPS for k in ("bounding", "effective", "permitted")},
                             "inheritable": [], "ambient": []},
            "noNewPrivileges": True,
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 4096, "soft": 4096}],
        },
        "root": {"path": str(spec.rootfs), "readonly": True},
        "hostname": "sandbox",
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "mode=755"]},
            {"destination": "/dev/pts", "type": "devpts", "source": "devpts"},
            # gVisor adds /dev/net/tun and /dev/fuse; an open tun fd makes this runsc
            # panic at the next checkpoint, so a kernel could kill its own sandbox. Nothing here needs them.
            {"destination": "/dev/net", "type": "tmpfs", "source": "tmpfs", "options": ["ro", "nosuid", "nodev", "mode=755"]},
            {"destination": "/dev/shm", "type": "tmpfs", "source": "shm", "options": tmpfs},
            {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs", "options": tmpfs},
            {"destination": "/workspace", "type": "bind", "source": str(spec.workspace), "options": ["rbind", "rw"]},
            {"destination": "/opt/sandgate", "type": "bind", "source": str(spec.agent_dir), "options": ["rbind", "ro"]},
        ],
        "linux": {
            "namespaces": [{"type": t} for t in ("pid", "ipc", "uts", "mount", "network")],
            "seccomp": no_namespaces(),
            "cgroupsPath": "/" + cgroup_name(spec.id),
            "resources": {
                "memory": {"limit": lim.memory_mb << 20},
                "pids": {"limit": lim.pids},
                "cpu": {"quota": int(lim.cpus * 100_000), "period": 100_000},
            },
        },
    }


SHIM = Path(__file__).with_name("shim.py")


class GVisorSandbox(ProcessSandbox):
    """``proc`` is the shim (drivers/shim.py) that holds runsc's stdio, so the
    sandbox outlives a killed gateway; the agent's stream is the shim's socket."""

    def __init__(self, spec: SandboxSpec, driver: "GVisorDriver"):
        super().__init__(spec)
        self.driver = driver
        self.sockets = socket_dir(driver.home, spec.id, "g")
        self.reclaiming: Optional[asyncio.Future] = None  # reclaim_restore_heap, after a restore (after_restore())
        self.log_path = self.sockets / "runsc.log"  # runsc's stderr: a file outlives the gateway, a pipe would not

    async def start(self, restore_from: Optional[Path] = None) -> None:
        bundle = self.spec.state_dir / "bundle"
        bundle.mkdir(parents=True, exist_ok=True)
        self.sockets.mkdir(mode=0o700, exist_ok=True)
        # The workspace is a plain directory or a Workspace's mount point (then it exists).
        self.spec.workspace.mkdir(parents=True, exist_ok=True)
        uid = sandbox_uid()
        os.chown(self.spec.workspace, uid, uid) if os.geteuid() == 0 else None
        argv = ["/usr/bin/python3", "-m", "sandgate_agent.agent", "--transport", "stdio",
                "--workspace", "/workspace", "--runtime-dir", "/tmp/sandgate", "--user", str(uid), "--pid-namespace"]
        (bundle / "config.json").write_text(json.dumps(oci_config(self.spec, argv), indent=1))
        (self.sockets / "spec.json").write_text(self.spec.model_dump_json())
        verb = ["restore", "--image-path", str(restore_from)] if restore_from else ["run"]
        # --detach: runsc exits once the sandbox runs, instead of one more Go process per
        # sandbox waiting on it (~5 MiB PSS); the shim adopts the sandbox as its subreaper.
        pidfile = str(self.sockets / "sandbox.pid")
        with open(self.log_path, "ab") as stderr:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-I", "-S", str(SHIM), str(self.sockets / "shim.sock"), str(self.sockets / "status"),
                "--detached", pidfile, "--cgroup", cgroup_name(self.id), *self.driver.lease.shim_args(),
                "--cleanup", *self.driver.runsc_args(), "delete", "--force", self.id, "--",
                *self.driver.runsc_args(), *verb, "--detach", "--pid-file", pidfile, "--bundle", str(bundle), self.id,
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=stderr,
                start_new_session=True)
        release(self.proc.pid)  # the shim outlives the gateway: not under its memory limit
        (self.sockets / "shim.pid").write_text(str(self.proc.pid))
        await self.connect()

    async def connect(self) -> None:
        """The agent's stream, through the shim's socket."""
        self.reader, self.writer = await connect_unix(self.sockets / "shim.sock", lambda: self.running, 30,
                                                      "the sandbox's stream")

    def exit_status(self) -> Optional[int]:
        try:
            return int((self.sockets / "status").read_text())
        except (OSError, ValueError):
            return None

    def failure(self) -> str:
        code = self.proc.returncode if self.proc else None
        if code is None:
            what = "sandbox is running"
        elif code in (137, -9):
            what = f"sandbox was killed (exit status {code}: SIGKILL, typically the {self.spec.limits.memory_mb} MB memory limit)"
        else:
            what = f"sandbox exited with status {code}"
        tail = tail_lines(self.log_path)[-5:]
        return what + (": " + " | ".join(tail) if tail else "")

    async def destroy(self) -> None:
        if self.reclaiming:
            self.reclaiming.cancel()
        if self.writer:
            self.writer.close()
        if self.proc and self.proc.returncode is None:
            await self.driver.runsc("kill", self.id, "KILL")
            try:
                await asyncio.wait_for(self.proc.wait(), 10)
            except asyncio.TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        await self.driver.delete(self.id)
        shutil.rmtree(self.spec.state_dir, ignore_errors=True)
        shutil.rmtree(self.sockets, ignore_errors=True)


PF_EXITING, PF_KTHREAD = 0x4, 0x200000  # include/linux/sched.h


def _exiting(pid: int) -> bool:
    """Whether process ``pid`` is exiting or a zombie (not a kernel thread:
    some take SIGKILL). Raises OSError when it is gone."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ", which may hold spaces
    state, flags = fields[0], int(fields[6])
    return not flags & PF_KTHREAD and (state in ("Z", "X") or bool(flags & PF_EXITING))


async def _shim_gone(sockets: Path, timeout: float = 10) -> None:
    """Wait (bounded) for the shim of the runtime whose socket directory this is to exit."""
    try:
        pid = int((sockets / "shim.pid").read_text())
    except (OSError, ValueError):
        return
    end = time.monotonic() + timeout
    while process_has(pid, str(sockets / "shim.sock")) and not _exiting(pid) and time.monotonic() < end:
        await asyncio.sleep(0.05)


def _checkpointing(runtime: str) -> bool:
    """Whether a `runsc ... checkpoint ... <runtime>` process runs."""
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            argv = (p / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"checkpoint" in argv and runtime.encode() in argv and b"runsc" in argv[0]:
            return True
    return False


def reclaim_enabled(setting: str, rootless: bool, runsc_date: int) -> bool:
    """`auto` is on as root with a runsc older than directfs. As root (with
    --network=none) the Sentry runs as nobody in an empty read-only tmpfs root
    whose /proc runsc unmounts before installing the Sentry's seccomp filter,
    and (before directfs) it holds no host directory, so the read-only openat
    that `--profile` adds to that filter reaches nothing (tests/test_drivers.py
    checks all three). Rootless, /proc stays mounted (under ptrace it is the
    host's); a directfs runsc hands the Sentry directories of the host: not
    verified there, so off unless set. Anything but a yes or a no is `auto`."""
    setting = setting.strip().lower()
    if setting in ("1", "true", "yes", "on"):
        return True
    if setting in ("0", "false", "no", "off"):
        return False
    return not rootless and 0 < runsc_date < DIRECTFS_SINCE


class GVisorDriver(Driver):
    name = "gvisor"
    # runsc's image (unwrapped and chunked, state_chunks.py); a newer runsc with --compression=none
    # writes the memory beside it, uncompressed, in pages.img (chunked as it is)
    state_images = ("checkpoint.img", "pages.img")

    def __init__(self, root_dir: str, settings: "Settings"):
        self.root_dir = root_dir
        self.home = Path(root_dir).parents[1]
        self.settings = settings
        self.runsc_path = runsc_path(settings.runsc)
        self.platform = settings.runsc_platform
        os.makedirs(root_dir, exist_ok=True)

    @classmethod
    def probe(cls, settings: "Settings") -> Tuple[bool, str]:
        path = runsc_path(settings.runsc)
        if not path:
            return False, "runsc not found (apt-get install runsc)"
        return True, f"runsc at {path}"

    def runsc_args(self) -> List[str]:
        args = [self.runsc_path or "runsc", "--root", self.root_dir, "--network=none", f"--platform={self.platform}",
                "--oci-seccomp"]
        if os.geteuid() != 0:
            args.append("--rootless")
        if self.reclaim:
            args.append("--profile")  # the Sentry's profile RPCs: reclaim_restore_heap's way to run its GC
        return args

    def after_restore(self, sandbox: Sandbox) -> None:
        if self.reclaim and isinstance(sandbox, GVisorSandbox):
            sandbox.reclaiming = asyncio.ensure_future(self.reclaim_restore_heap(sandbox))

    async def reclaim_restore_heap(self, sandbox: GVisorSandbox) -> None:
        """Hand the restore's garbage back to the host now, not in 4-5 minutes:
        each heap profile request runs runtime.GC() in the Sentry; the second
        and third free what finalizers held through the first, and Go's
        scavenger returns the pages within seconds (PSS ~140 -> ~68 MiB).
        Started once the restored agent has answered (after_restore()), so runsc
        has finished the restore."""
        sid = sandbox.id
        try:
            await asyncio.sleep(RECLAIM_DEFER)  # a deliberate delay (see RECLAIM_DEFER), not a wait for a condition
            if not sandbox.running:
                return  # gone already: nothing to reclaim
            # Not /dev/null: when the RPC fails, `runsc debug` removes the file it was given.
            profile = sandbox.sockets / "heap.prof"
            for _ in range(RECLAIM_GCS):
                code, out = await self.runsc("debug", "--delay=0s", f"--profile-heap={profile}", sid,
                                             timeout=RECLAIM_TIMEOUT)
                profile.unlink(missing_ok=True)
                if code != 0:  # the sandbox may already be gone; it only costs memory for a while
                    log.info("sandbox %s: restore heap not reclaimed: %s", sid, runsc_error(out))
                    return
            log.info("sandbox %s: restore heap reclaimed (runtime.GC x%d)", sid, RECLAIM_GCS)
        except (OSError, asyncio.TimeoutError) as e:  # memory only, not the sandbox's health
            log.info("sandbox %s: restore heap not reclaimed: %s", sid, str(e) or "runsc did not answer in time")

    async def runsc(self, *args: str, timeout: Optional[float] = None) -> Tuple[int, str]:
        """runsc with args; with a timeout, a runsc that outlasts it is killed."""
        p = await asyncio.create_subprocess_exec(*self.runsc_args(), *args, stdin=asyncio.subprocess.DEVNULL,
                                                 stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        try:
            out, _ = await asyncio.wait_for(p.communicate(), timeout)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            if p.returncode is None:
                p.kill()
                await p.wait()
            raise
        return p.returncode, out.decode(errors="replace")

    async def create(self, spec: SandboxSpec, restore_from: Optional[Path] = None) -> Sandbox:
        if not self.runsc_path:
            raise SandboxError("runsc not found: install gVisor (apt-get install runsc)")
        sb = GVisorSandbox(spec, self)
        try:
            await sb.start(restore_from)
        except (OSError, WorkspaceError) as e:
            await sb.destroy()
            raise SandboxError(f"could not start runsc: {e}") from None
        return sb

    async def adopt(self, runtime: str) -> Sandbox:
        sockets = socket_dir(self.home, runtime, "g")
        try:
            spec = SandboxSpec.model_validate_json((sockets / "spec.json").read_text())
            pid = int((sockets / "shim.pid").read_text())
        except (OSError, ValueError) as e:
            raise SandboxError(f"no handle on runtime {runtime}: {e}") from None
        sb = GVisorSandbox(spec, self)
        sb.proc = AdoptedProcess(pid, str(sockets / "shim.sock"), sb.exit_status)
        await sb.connect()
        return sb

    async def reap(self, keep: Iterable[str] = ()) -> int:
        keep = set(keep)
        code, out = await self.runsc("list", "-quiet")
        ids = [i for i in (line.strip() for line in out.splitlines()) if i.startswith("sg-") and i not in keep]
        for sid in ids if code == 0 else []:
            if self._names_its_sandbox(sid):
                try:  # a frozen sandbox does not die of a kill (runsc waits on it)
                    await self._set_frozen(sid, False)
                except SandboxError:
                    pass
                await self.runsc("kill", sid, "KILL")
                await self.delete(sid)
        kept = {socket_dir(self.home, i, "g") for i in keep}
        for d in Path(tempfile.gettempdir()).glob(f"sgg-{tag(str(self.home))}-*"):
            if d not in kept:
                await _shim_gone(d)  # it writes its runtime's exit status there as it goes
                self._remove_cgroups_named_in(d)
                shutil.rmtree(d, ignore_errors=True)
        return len(ids) if code == 0 else 0

    def _remove_cgroups_named_in(self, sockets: Path) -> None:
        """The cgroups of the runtime whose socket directory this was: a runtime stopped before
        runsc recorded it leaves nothing else that names them. Anyone can make a directory in
        /tmp, so only one of ours (owner, mode 0700, the name its spec's id gives) is believed."""
        try:
            st = sockets.lstat()
            runtime_id = SandboxSpec.model_validate_json((sockets / "spec.json").read_text()).id
        except (OSError, ValueError):
            return
        if (st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o700 and stat.S_ISDIR(st.st_mode)
                and RUNTIME_ID.fullmatch(runtime_id) and socket_dir(self.home, runtime_id, "g") == sockets):
            remove_cgroups(cgroup_name(runtime_id))

    def _record(self, sid: str) -> Path:
        """runsc's record of a sandbox (the same name in Debian 12's and 13's runsc)."""
        return Path(self.root_dir) / f"{sid}_sandbox:{sid}.state"

    async def delete(self, sid: str) -> None:
        """`runsc delete --force`, if runsc still has a record of the sandbox (its shim
        deletes it when the sandbox ends) and that record names no other process; then
        its cgroups, which a launcher stopped before runsc recorded the sandbox leaves
        behind (runtime ids are never reused, and a cgroup in use is not removed)."""
        if self._record(sid).exists() and self._names_its_sandbox(sid):
            await self.runsc("delete", "--force", sid)
        remove_cgroups(cgroup_name(sid))

    def _names_its_sandbox(self, sid: str) -> bool:
        """Whether runsc's record of ``sid`` is safe to act on: `runsc delete` SIGKILLs the
        Sentry's and the gofer's pids it recorded, unchecked. A sandbox that ended while
        neither its shim nor a gateway was there to clean up leaves a record whose pids
        other processes may have by now: that record is left alone, with a warning."""
        try:
            rec = json.loads(self._record(sid).read_text())
            pids = [rec.get("goferPid"), (rec.get("sandbox") or {}).get("pid")]
            bundle = str(rec.get("bundleDir") or "").encode()
        except (OSError, ValueError, AttributeError):
            return True  # no record runsc could act on, or not this runsc's format: runsc decides
        for pid in pids:
            if not isinstance(pid, int) or pid <= 0:
                continue
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                ending = _exiting(pid)
            except OSError:
                continue  # gone: nothing to kill there
            if ending:
                # Exiting or a zombie (typically the sandbox that just ended, not yet reaped): a
                # SIGKILL does nothing to it, so runsc delete can do no harm. Read as a stranger's
                # (its command line is empty), the record and cgroups of every sandbox killed from
                # outside or by its memory limit stayed behind.
                continue
            if not (b"runsc" in cmdline and bundle and bundle in cmdline):
                log.warning("runsc's record of %s names pid %d, which is not its sandbox's now: left alone "
                            "(`runsc --root %s delete --force %s` once that process is gone)", sid, pid,
                            self.root_dir, sid)
                return False
        return True

    @staticmethod
    def memory_in_use(sandbox_id: str) -> Optional[int]:
        for path in (f"/sys/fs/cgroup/memory/{cgroup_name(sandbox_id)}/memory.usage_in_bytes",  # cgroup v1
                     f"/sys/fs/cgroup/{cgroup_name(sandbox_id)}/memory.current"):  # v2
            try:
                return int(Path(path).read_text())
            except (OSError, ValueError):
                continue
        return None

    @functools.cached_property
    def _checkpoint_flags(self) -> str:
        """`runsc checkpoint --help`: which options this runsc has (asked once)."""
        return _run_quietly([self.runsc_path or "runsc", "checkpoint", "--help"])

    @functools.cached_property
    def runsc_date(self) -> int:
        """The release date in `runsc --version` (0.0~20221219.0, release-20240729.0), 0 if none."""
        m = re.search(r"(20\d{6})", _run_quietly([self.runsc_path or "runsc", "--version"]))
        return int(m.group(1)) if m else 0

    @functools.cached_property
    def reclaim(self) -> bool:
        return reclaim_enabled(self.settings.runsc_reclaim, os.geteuid() != 0, self.runsc_date)

    @property
    def checkpoints_in_place(self) -> bool:
        # Debian 12's runsc (20221219) lists --leave-running too, but its sandbox is gone after
        # such a checkpoint; Debian 13's (20240729) pauses it and carries on, as tested here.
        if self.settings.checkpoint_in_place in ("0", "false", "no", "off"):
            return False
        return self.runsc_date >= IN_PLACE_SINCE and "-leave-running" in self._checkpoint_flags

    def _make_room(self, sandbox: Sandbox, image_dir: Path) -> None:
        image_dir.mkdir(parents=True, exist_ok=True)
        # runsc stops the sandbox even when writing the image fails, so a
        # full disk would kill it: refuse up front unless the image fits.
        # The image is at most the sandbox's memory in use (usually a fifth
        # compressed, all of it with SANDGATE_RUNSC_COMPRESSION=none).
        require_disk_for_checkpoint(image_dir, (self.memory_in_use(sandbox.id) or 256 << 20) + (16 << 20))

    def _image_args(self, image_dir: Path) -> List[str]:
        args = ["--image-path", str(image_dir)]
        compression = self.settings.runsc_compression
        if compression and "-compression" in self._checkpoint_flags:
            args.append(f"--compression={compression}")
        return args

    async def checkpoint_in_place(self, sandbox: Sandbox, image_dir: Path) -> None:
        self._make_room(sandbox, image_dir)
        # Paused first, so the sandbox stays where its image has it while the caller
        # snapshots the workspace: memory and files of one instant.
        code, out = await self.runsc("pause", sandbox.id)
        if code != 0:
            raise SandboxError(f"runsc pause failed: {runsc_error(out)}")
        code, out = await self.runsc("checkpoint", "--leave-running", *self._image_args(image_dir), sandbox.id)
        if code != 0:
            if sandbox.running:
                try:
                    await self.unpause(sandbox)
                except SandboxError as e:  # the checkpoint's error is the one to report; the core checks the rest
                    log.warning("sandbox %s: not resumed after its failed checkpoint: %s", sandbox.id, e)
            raise SandboxError(f"runsc checkpoint failed: {runsc_error(out)}")

    async def unpause(self, sandbox: Sandbox) -> None:
        code, out = await self.runsc("resume", sandbox.id)
        if code != 0:
            raise SandboxError(f"runsc resume failed: {runsc_error(out)}")

    async def checkpoint(self, sandbox: Sandbox, image_dir: Path) -> None:
        self._make_room(sandbox, image_dir)
        code, out = await self.runsc("checkpoint", *self._image_args(image_dir), sandbox.id)
        if code != 0:
            raise SandboxError(f"runsc checkpoint failed: {runsc_error(out)}")
        try:
            await asyncio.wait_for(sandbox.wait(), 30)
        except asyncio.TimeoutError:
            raise SandboxError("sandbox did not stop after its checkpoint") from None
        await self.delete(sandbox.id)

    async def settle(self, runtime: str, timeout: float = 120) -> None:
        # A `runsc checkpoint` is the killed gateway's child, not killed with it: it goes on
        # writing the image and then stops the sandbox. Adopting meanwhile would adopt a
        # sandbox about to stop; waiting tells which it is, running or a whole image.
        end = time.monotonic() + timeout
        while _checkpointing(runtime) and time.monotonic() < end:
            await asyncio.sleep(0.2)
        if time.monotonic() >= end:
            log.warning("runtime %s: a runsc checkpoint still runs after %g s", runtime, timeout)

    def image_whole(self, image_dir: Path) -> bool:
        return (image_dir / "checkpoint.img").is_file()

    async def freeze(self, sandbox: Sandbox) -> None:
        # The sandbox's freezer cgroup, not `runsc pause`: this runsc answers a
        # pause of a restored sandbox with success and leaves it running.
        try:
            await self._set_frozen(sandbox.id, True)
        except SandboxError:
            try:  # half frozen helps nobody: it runs on
                await self._set_frozen(sandbox.id, False)
            except SandboxError:
                pass
            raise

    async def thaw(self, sandbox: Sandbox) -> None:
        await self._set_frozen(sandbox.id, False)

    async def _set_frozen(self, sandbox_id: str, frozen: bool) -> None:
        v1 = Path(f"/sys/fs/cgroup/freezer/{cgroup_name(sandbox_id)}/freezer.state")
        v2 = Path(f"/sys/fs/cgroup/{cgroup_name(sandbox_id)}/cgroup.freeze")
        if v1.exists():
            control, want, done = v1, "FROZEN" if frozen else "THAWED", lambda: v1.read_text().strip() == want
        elif v2.exists():
            events = v2.with_name("cgroup.events")
            control, want = v2, "1" if frozen else "0"
            done = lambda: f"frozen {want}" in events.read_text()  # noqa: E731
        else:
            code, out = await self.runsc("pause" if frozen else "resume", sandbox_id)
            if code != 0:
                raise SandboxError(f"runsc {'pause' if frozen else 'resume'} failed: {out.strip()[-300:]}")
            return
        try:
            control.write_text(want)
            start = time.monotonic()
            again = start + 0.25
            while not done():  # freezing takes until every task has stopped
                now = time.monotonic()
                if now > start + FREEZE_TIMEOUT:
                    raise SandboxError(f"the sandbox did not {'freeze' if frozen else 'thaw'} within "
                                       f"{FREEZE_TIMEOUT:g} s")
                if control is v1 and now > again:
                    # v1 stays FREEZING when a task could not be frozen at the first try (one in a
                    # ptrace stop, common on a loaded host): writing FROZEN again tries those again.
                    control.write_text(want)
                    again = now + 0.25
                await asyncio.sleep(0.01)
        except OSError as e:
            raise SandboxError(f"cannot {'freeze' if frozen else 'thaw'} the sandbox: {e}") from None

    async def restore(self, spec: SandboxSpec, image_dir: Path, consume: bool = False) -> Sandbox:
        if not (image_dir / "checkpoint.img").is_file():
            raise SandboxError(f"checkpoint image missing in {image_dir}")
        return await self.create(spec, restore_from=image_dir)
