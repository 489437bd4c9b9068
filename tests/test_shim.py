"""The shim (gateway/drivers/shim.py) that holds a runtime's stdio for the
gateway, run for real as its own process around a stand-in runtime: a Python
program that speaks the agent's framing on stdin/stdout (runsc itself runs
behind the shim in test_drivers.py and test_restart.py)."""

from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import wait_for

SHIM = Path(__file__).resolve().parent.parent / "gateway" / "drivers" / "shim.py"
PREFIX = struct.Struct(">II")

# The stand-in runtime: echoes each frame back, and obeys a few commands
# (the frame's header) that the tests use to time what it writes.
RUNTIME = r'''
import os, struct, sys, time
P = struct.Struct(">II")
inp, out = sys.stdin.buffer, sys.stdout.buffer
def frame(h, p=b""):
    return P.pack(len(h), len(p)) + h + p
def wait_file(path):
    while not os.path.exists(path):
        time.sleep(0.01)
while True:
    pre = inp.read(8)
    if len(pre) < 8:
        sys.exit(0)
    hl, pl = P.unpack(pre)
    head, body = inp.read(hl), inp.read(pl)
    if head == b"exit":
        sys.exit(int(body))
    elif head == b"kill":
        os.kill(os.getpid(), 9)
    elif head == b"later":  # write a frame once a file exists, then say so in another file
        go, done = body.decode().split("|")
        wait_file(go)
        out.write(frame(b"late", b"hello")); out.flush()
        open(done, "w").close()
    elif head == b"split":  # half a frame, then (once a file exists) the rest and one more
        big = frame(b"big", b"x" * 100000)
        out.write(big[:50000]); out.flush()
        wait_file(body.decode())
        out.write(big[50000:] + frame(b"next", b"after")); out.flush()
    elif head == b"flood":  # many 1 MiB frames, as fast as the pipe takes them, counted in a file
        n, progress = body.decode().split("|")
        for i in range(int(n)):
            out.write(frame(b"flood", bytes([i % 256]) * (1 << 20))); out.flush()
            with open(progress, "w") as f:
                f.write(str(i + 1))
        out.write(frame(b"flooded")); out.flush()
    else:
        out.write(frame(head, body)); out.flush()
'''


def frame(head: bytes, payload: bytes = b"") -> bytes:
    return PREFIX.pack(len(head), len(payload)) + head + payload


def recv_exact(s: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise EOFError(f"closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def recv_frame(s: socket.socket):
    hl, pl = PREFIX.unpack(recv_exact(s, PREFIX.size))
    return recv_exact(s, hl), recv_exact(s, pl)


# A launcher as `runsc run --detach --pid-file F` is: it starts the runtime
# (RUNTIME) in a child that keeps its stdio, writes the child's pid to F and
# exits 0 before the child does. argv[2] changes what it does instead.
LAUNCHER = r'''
import os, sys
pidfile, how = sys.argv[1], sys.argv[2]
if how == "fail":
    sys.exit(3)
if how == "no-pidfile":
    sys.exit(0)
if how.startswith("stranger:"):  # names a process that is not its child
    with open(pidfile, "w") as f:
        f.write(how.split(":")[1])
    sys.exit(0)
if how in ("with-gofer", "dies-after-start"):  # a second process beside the sandbox, as runsc's gofer
    gofer = os.fork()
    if gofer == 0:
        os.execvp("sleep", ["sleep", "300"])
    with open(pidfile + ".gofer", "w") as f:
        f.write(str(gofer))
pid = os.fork()
if pid == 0:
    os.execv(sys.executable, [sys.executable, "-c", sys.argv[3]])
with open(pidfile, "w") as f:
    f.write(str(pid))
if how == "dies-after-start":  # as a runsc killed (say, by the memory cgroup it waits in) after starting
    os.kill(os.getpid(), 9)
'''


def shim_argv(tmp: Path, detached: str = "", cgroup: str = "", lease: tuple = ()) -> list:
    runtime, options = [sys.executable, "-c", RUNTIME], []
    if detached:
        runtime = [sys.executable, "-c", LAUNCHER, str(tmp / "sandbox.pid"), detached, RUNTIME]
        # the cleanup (runsc delete) notes which of the launcher's processes were still there when it ran
        cleanup = [sys.executable, "-c", "import os, sys; open(sys.argv[1], 'w').write(repr(sorted(os.listdir('/proc'))))",
                   str(tmp / "cleaned-up")]
        options = ["--detached", str(tmp / "sandbox.pid"), *(["--cgroup", cgroup] if cgroup else []),
                   *(["--lease", str(lease[0]), str(lease[1])] if lease else []), "--cleanup", *cleanup]
    return [sys.executable, "-I", "-S", str(SHIM), str(tmp / "shim.sock"), str(tmp / "status"), *options, "--", *runtime]


class Running:
    def __init__(self, tmp: Path, detached: str = ""):
        self.sock, self.status, self.pidfile = tmp / "shim.sock", tmp / "status", tmp / "sandbox.pid"
        self.tmp = tmp
        self.proc = subprocess.Popen(shim_argv(tmp, detached), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     start_new_session=True)
        wait_for(self.listening, timeout=30)

    def listening(self) -> bool:
        try:
            self.connect().close()  # a probe the shim takes as a gateway that came and went
            return True
        except OSError:
            return False

    def connect(self) -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(30)
        s.connect(str(self.sock))
        return s

    def close(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@pytest.fixture
def shim(tmp_path):
    r = Running(tmp_path)
    yield r
    r.close()


def test_frames_pass_both_ways(shim):
    s = shim.connect()
    for i in range(3):
        s.sendall(frame(b"echo%d" % i, b"p" * (i * 70000)))
    for i in range(3):
        assert recv_frame(s) == (b"echo%d" % i, b"p" * (i * 70000))


def test_a_new_connection_replaces_the_old_one(shim):
    first = shim.connect()
    first.sendall(frame(b"a"))
    assert recv_frame(first) == (b"a", b"")
    second = shim.connect()
    assert first.recv(1) == b""  # the shim closed the old gateway's socket
    second.sendall(frame(b"b"))
    assert recv_frame(second) == (b"b", b"")


def test_half_a_frame_from_a_gateway_that_went_away_never_reaches_the_runtime(shim):
    first = shim.connect()
    first.sendall(PREFIX.pack(4, 100) + b"half" + b"y" * 10)  # 86 payload bytes never come
    first.close()
    second = shim.connect()
    second.sendall(frame(b"whole", b"z"))
    assert recv_frame(second) == (b"whole", b"z")  # had the half frame gone on, this would be its payload


def test_a_frame_written_while_no_gateway_is_connected_waits_for_the_next(shim):
    go, done = shim.tmp / "go", shim.tmp / "done"
    first = shim.connect()
    first.sendall(frame(b"later", f"{go}|{done}".encode()))
    first.close()
    go.touch()
    wait_for(done.exists, timeout=30)  # the runtime wrote its frame with no gateway connected
    second = shim.connect()
    assert recv_frame(second) == (b"late", b"hello")


def test_a_frame_the_gateway_missed_the_start_of_is_skipped(shim):
    go = shim.tmp / "go"
    first = shim.connect()
    first.sendall(frame(b"split", str(go).encode()))
    assert len(first.recv(1000)) > 0  # the big frame has begun on this connection
    first.close()
    second = shim.connect()
    go.touch()
    assert recv_frame(second) == (b"next", b"after")  # not the big frame's tail read as a frame


def blocked_writing_stdout(pid: int) -> bool:
    """The process sits in write(1, ...) (/proc/PID/syscall: number, then arguments)."""
    try:
        fields = Path(f"/proc/{pid}/syscall").read_text().split()
    except OSError:
        return False
    return fields[:2] == ["1", "0x1"]


def test_a_gateway_that_does_not_read_holds_the_runtime_back_instead_of_filling_the_shim(shim):
    progress = shim.tmp / "progress"
    s = shim.connect()
    s.sendall(frame(b"flood", f"64|{progress}".encode()))
    runtime = psutil.Process(shim.proc.pid).children()[0].pid
    count = lambda: int(progress.read_text() or 0) if progress.exists() else 0  # noqa: E731

    def stalled():  # in write(1) with the count unchanged across two looks: not just mid-write
        before = count()
        if not blocked_writing_stdout(runtime):
            return False
        time.sleep(0.2)  # the gap between the two looks; the condition is what they see
        return blocked_writing_stdout(runtime) and count() == before

    wait_for(stalled, timeout=60)
    # Without backpressure the shim would have taken all 64 MiB and the runtime be done writing.
    assert count() < 24, count()
    status = Path(f"/proc/{shim.proc.pid}/status").read_text()
    rss_kib = int(next(line for line in status.splitlines() if line.startswith("VmRSS")).split()[1])
    assert rss_kib < 40 << 10, f"the shim holds {rss_kib} KiB"
    for i in range(64):  # and nothing is lost once the gateway reads
        head, payload = recv_frame(s)
        assert head == b"flood" and payload == bytes([i % 256]) * (1 << 20)
    assert recv_frame(s) == (b"flooded", b"")


def test_an_oversized_frame_from_a_gateway_drops_that_gateway(shim):
    first = shim.connect()
    first.sendall(PREFIX.pack(0, 300 << 20))  # over the agent's 256 MiB limit
    assert first.recv(1) == b""
    second = shim.connect()
    second.sendall(frame(b"after"))
    assert recv_frame(second) == (b"after", b"")


def test_what_the_runtime_wrote_before_it_exited_still_reaches_the_gateway(shim):
    s = shim.connect()
    s.sendall(frame(b"last words") + frame(b"exit", b"0"))
    assert recv_frame(s) == (b"last words", b"")
    assert shim.proc.wait(timeout=30) == 0


@pytest.mark.parametrize("command, payload, status, rc", [
    (b"exit", b"3", "3", 3),
    (b"kill", b"", "-9", 137),
])
def test_the_runtime_exit_status_is_written_and_the_shim_ends(shim, command, payload, status, rc):
    s = shim.connect()
    s.sendall(frame(command, payload))
    assert shim.proc.wait(timeout=30) == rc
    assert shim.status.read_text() == status
    assert s.recv(1) == b""


def test_a_stale_socket_from_an_earlier_run_is_replaced(tmp_path):
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(tmp_path / "shim.sock"))
    stale.close()  # the file stays, as after a crash
    r = Running(tmp_path)
    try:
        s = r.connect()
        s.sendall(frame(b"ping"))
        assert recv_frame(s) == (b"ping", b"")
    finally:
        r.close()


@pytest.fixture
def detached(tmp_path):
    r = Running(tmp_path, detached="start")
    yield r
    r.close()


def test_a_detached_runtime_is_waited_on_by_the_shim_once_its_launcher_exits(detached):
    s = detached.connect()
    s.sendall(frame(b"ping"))
    assert recv_frame(s) == (b"ping", b"")
    sandbox = int(detached.pidfile.read_text())
    shim = psutil.Process(detached.proc.pid)
    # The launcher is gone (nothing left waiting on the sandbox): the sandbox is the shim's child now.
    wait_for(lambda: [c.pid for c in shim.children()] == [sandbox], timeout=30)
    s.sendall(frame(b"still there"))
    assert recv_frame(s) == (b"still there", b"")
    s.sendall(frame(b"exit", b"4"))
    assert detached.proc.wait(timeout=30) == 4  # the sandbox's status, not the launcher's 0
    assert detached.status.read_text() == "4"
    assert s.recv(1) == b""


def test_a_detached_runtime_killed_is_reported_as_killed(detached):
    s = detached.connect()
    s.sendall(frame(b"kill"))
    assert detached.proc.wait(timeout=30) == 137
    assert detached.status.read_text() == "-9"


@pytest.mark.parametrize("how, rc", [("fail", 3), ("no-pidfile", 125)])
def test_a_launcher_that_fails_or_names_no_sandbox_ends_the_shim(tmp_path, how, rc):
    (tmp_path / "sandbox.pid").write_text("1")  # stale, from an earlier run: not this run's sandbox
    proc = subprocess.Popen(shim_argv(tmp_path, how), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, start_new_session=True)
    try:
        assert proc.wait(timeout=30) == rc
        assert (tmp_path / "status").read_text() == str(rc)
        if how == "no-pidfile":
            assert b"without naming its sandbox" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_a_sandbox_that_is_not_the_shims_child_is_watched_until_it_exits(tmp_path):
    stranger = subprocess.Popen(["sleep", "60"])
    proc = subprocess.Popen(shim_argv(tmp_path, f"stranger:{stranger.pid}"), stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        wait_for(lambda: any(os.readlink(f"/proc/{proc.pid}/fd/{fd}") == "anon_inode:[pidfd]"
                             for fd in os.listdir(f"/proc/{proc.pid}/fd")), timeout=30)  # it holds a pidfd
        assert proc.poll() is None  # it runs on while the sandbox does
        stranger.kill()
        stranger.wait()
        assert proc.wait(timeout=30) == 255  # its exit status is unknown
        assert b"not this shim's child" in proc.stderr.read()
    finally:
        stranger.kill()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def pid_in(path: Path) -> str:
    """The pid a launcher wrote to ``path``; "" until it has (no file yet, or opened but not written)."""
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        return ""


def gone(pid: int) -> bool:
    """Not running: exited (a zombie init has yet to reap counts) or never there."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_when_the_sandbox_ends_the_rest_is_ended_and_the_cleanup_runs(tmp_path):
    r = Running(tmp_path, detached="with-gofer")
    try:
        s = r.connect()
        s.sendall(frame(b"exit", b"5"))
        # The shim listens before its launcher has run: the launcher writes this file once it does.
        gofer = int(wait_for(lambda: pid_in(tmp_path / "sandbox.pid.gofer"), timeout=30))
        assert r.proc.wait(timeout=60) == 5  # within the 5 s it gives the gofer, then killed
        assert gone(gofer)  # not left to init
        listed = (tmp_path / "cleaned-up").read_text()  # the cleanup ran before the shim exited...
        assert repr(str(gofer)) not in listed  # ...and after the gofer was gone
    finally:
        r.close()


def test_a_launcher_that_dies_after_starting_the_sandbox_leaves_nothing_running(tmp_path):
    proc = subprocess.Popen(shim_argv(tmp_path, "dies-after-start"), stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        assert proc.wait(timeout=60) == 137  # the launcher's status
        sandbox = int((tmp_path / "sandbox.pid").read_text())
        gofer = int((tmp_path / "sandbox.pid.gofer").read_text())
        assert gone(sandbox) and gone(gofer)  # killed, not left running under init
        assert (tmp_path / "cleaned-up").exists()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def make_cgroups(name: str) -> list:
    """Empty cgroups ``name`` in the memory and pids hierarchies (v1) or the unified one (v2),
    as runsc makes them for a sandbox before it has recorded it."""
    root = Path("/sys/fs/cgroup")
    dirs = [root / "memory" / name, root / "pids" / name] if (root / "memory").is_dir() else [root / name]
    for d in dirs:
        d.mkdir(parents=True)
    return dirs


def test_a_launcher_stopped_before_runsc_recorded_its_sandbox_leaves_no_cgroups(tmp_path):
    """runsc makes the sandbox's cgroups first; a launcher that fails (or is killed) before it
    records the sandbox leaves them to no `runsc delete`. The shim removes them as it ends,
    except one that a process still holds: the kernel refuses that rmdir."""
    empty, busy = (f"sandgate/sg-shimtest-{os.urandom(4).hex()}" for _ in range(2))
    made = make_cgroups(empty) + make_cgroups(busy)
    holder = subprocess.Popen(["sleep", "300"])
    held = made[len(made) // 2]  # busy's first: memory (v1) or its only one (v2)
    (held / "cgroup.procs").write_text(str(holder.pid))
    try:
        for name in (empty, busy):
            (tmp_path / name).mkdir(parents=True)
            proc = subprocess.Popen(shim_argv(tmp_path / name, "fail", cgroup=name), stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
            assert proc.wait(timeout=30) == 3
        assert [d for d in made if d.exists()] == [held]
        assert (held / "cgroup.procs").read_text().split() == [str(holder.pid)]
    finally:
        holder.kill()
        holder.wait()
        for d in made:
            if d.exists():
                wait_for(lambda: not (d / "cgroup.procs").read_text().strip(), timeout=30)
                d.rmdir()


def test_a_runtime_ends_once_no_gateway_holds_it_or_renews_its_lease(tmp_path):
    """A gateway connected, or a lease file renewed, keeps the runtime past its lease's length;
    with neither, it is ended (and cleaned up as any ended sandbox) within about one lease."""
    lease, seconds = tmp_path / "runtimes.lease", 2.0
    lease.touch()
    proc = subprocess.Popen(shim_argv(tmp_path, "with-gofer", lease=(lease, seconds)), stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        sock = tmp_path / "shim.sock"
        s = wait_for(lambda: _connected(sock), timeout=30)
        s.sendall(frame(b"ping"))
        assert recv_frame(s) == (b"ping", b"")
        sandbox = int(wait_for(lambda: pid_in(tmp_path / "sandbox.pid"), timeout=30))
        gofer = int(wait_for(lambda: pid_in(tmp_path / "sandbox.pid.gofer"), timeout=30))
        with pytest.raises(subprocess.TimeoutExpired):  # held by a gateway, the stale file does not matter
            proc.wait(timeout=3 * seconds)
        s.close()
        end = time.monotonic() + 3 * seconds
        while time.monotonic() < end:  # no gateway, but the lease renewed, as a gateway restarting does
            lease.touch()
            assert proc.poll() is None
            time.sleep(0.2)
        t0 = time.monotonic()
        assert proc.wait(timeout=30) == 137  # no gateway, no renewal: SIGKILLed
        assert time.monotonic() - t0 < seconds + 10  # a lease, a check's interval, the 5 s this gofer is given, slack
        assert (tmp_path / "status").read_text() == "-9"
        assert gone(sandbox) and gone(gofer)
        assert (tmp_path / "cleaned-up").exists()  # runsc delete ran, as for any sandbox that ended
        assert b"no gateway for 2 s" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_a_frozen_runtime_past_its_lease_is_thawed_to_be_ended(tmp_path):
    """A sandbox paused in memory sits in a frozen cgroup, where SIGKILL waits for a thaw: the shim
    thaws it after the kill, so the lease ends it too."""
    name = f"sandgate/sg-shimtest-{os.urandom(4).hex()}"
    v1 = Path("/sys/fs/cgroup/freezer") / name
    group = v1 if v1.parent.parent.is_dir() else Path("/sys/fs/cgroup") / name
    control, frozen = (("freezer.state", "FROZEN") if group == v1 else ("cgroup.freeze", "1"))
    group.mkdir(parents=True)
    lease = tmp_path / "runtimes.lease"  # never written: only the shim's start counts
    argv = shim_argv(tmp_path, "start", cgroup=name, lease=(lease, 1.0))
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        sandbox = int(wait_for(lambda: pid_in(tmp_path / "sandbox.pid"), timeout=30))
        (group / "cgroup.procs").write_text(str(sandbox))
        (group / control).write_text(frozen)
        if group == v1:
            wait_for(lambda: (group / "freezer.state").read_text().strip() == "FROZEN", timeout=30)
        assert proc.wait(timeout=60) == 137
        assert gone(sandbox)
        assert not group.exists()  # emptied by the kill, removed as the shim ended
    finally:
        if proc.poll() is None:
            (group / control).write_text("THAWED" if group == v1 else "0")
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if group.exists():
            wait_for(lambda: not (group / "cgroup.procs").read_text().strip(), timeout=30)
            group.rmdir()


def _connected(path: Path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    try:
        s.connect(str(path))
        return s
    except OSError:
        s.close()
        return None
