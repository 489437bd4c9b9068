"""The suite every driver must pass, run against real sandboxes: gVisor
(runsc) and QEMU microVMs (TCG here). Each driver gets its own gateway. The
tests share one sandbox per driver while it lives (a cold VM boot is slow under
TCG), but none depends on another: the ``sb`` fixture hands each test a live
sandbox in the state it starts from (``x = 41``, ``data/in.txt``), making a new
one when a test before it deleted or killed it, so any test runs alone (-k)."""

import asyncio
import os
import re
import stat
import time
from pathlib import Path

import psutil
import pytest

from conftest import host_processes, wait_for
from sandgate.config import Settings
from sandgate.drivers.base import socket_dir
from sandgate.workspace import reap_mounts, sandbox_uid

def ex(gw, sid, code, timeout=120):
    return gw.run_code(sid, code, timeout)  # the SDK (conftest)


def create(gw, **body):
    return gw.create(driver=gw.driver, **body)


def cgroups_of(runtime):
    """The cgroup directories runsc made for a gVisor sandbox (v1: one per controller)."""
    return [*Path("/sys/fs/cgroup").glob(f"*/sandgate/{runtime}"), *Path("/sys/fs/cgroup/sandgate").glob(runtime)]


@pytest.fixture(scope="module")
def gw(driver_gw):
    return driver_gw


@pytest.fixture(scope="module")
def shared(gw):
    """The sandbox the tests of one driver share while it lives (see ``sb``)."""
    box = {"id": None}
    yield box
    if box["id"]:
        gw.request("DELETE", f"/api/sandboxes/{box['id']}")


IN_TXT = b"from the host"


@pytest.fixture
def sb(gw, shared):
    """A running sandbox in the state every test starts from: ``x = 41`` in the
    kernel, ``data/in.txt`` in the workspace. Nothing else may be assumed."""
    sid = shared["id"]
    if sid:
        r = gw.request("GET", f"/api/sandboxes/{sid}")
        if r.status != 200 or "dead" in (r.json().get("state"), r.json().get("execution_state")):
            gw.request("DELETE", f"/api/sandboxes/{sid}")
            sid = shared["id"] = None
    if not sid:
        sid = shared["id"] = create(gw)["id"]
    assert ex(gw, sid, "x = 41").status == "ok"  # resumes it, too, if a test left it paused
    assert gw.request("PUT", f"/api/sandboxes/{sid}/files/data/in.txt", raw=IN_TXT).status == 201
    return sid


def test_start_execute_and_files(gw, sb):
    info = gw.request("GET", f"/api/sandboxes/{sb}").json()
    assert info["driver"] == gw.driver and info["state"] == "running"
    out = ex(gw, sb, "import os\ny = 7\nprint(x, y, os.getuid(), os.getcwd())")
    # gVisor's files reach the host as the sandbox user's: a uid no host account has.
    # A VM's uid stays inside its own disk image.
    uid = sandbox_uid() if gw.driver == "gvisor" else 1000
    assert out.status == "ok" and out.stdout == f"41 7 {uid} /workspace\n"
    assert gw.request("PUT", f"/api/sandboxes/{sb}/files/data/new.txt", raw=b"new from the host").status == 201
    assert ex(gw, sb, "print(open('data/new.txt').read())").stdout == "new from the host\n"
    ex(gw, sb, "open('out.bin', 'wb').write(bytes(range(256)))")
    r = gw.request("GET", f"/api/sandboxes/{sb}/files/out.bin")
    assert r.status == 200 and r.body == bytes(range(256))
    names = {e["name"] for e in gw.request("GET", f"/api/sandboxes/{sb}/files/").json()["entries"]}
    assert {"data", "out.bin"} <= names
    assert {e["name"] for e in gw.request("GET", f"/api/sandboxes/{sb}/files/data").json()["entries"]} >= \
        {"in.txt", "new.txt"}
    assert gw.request("DELETE", f"/api/sandboxes/{sb}/files/out.bin").status == 204
    assert gw.request("GET", f"/api/sandboxes/{sb}/files/out.bin").status == 404


def test_interrupt_a_running_cell(gw, sb):
    out = ex(gw, sb, "import time\nfor i in range(600): time.sleep(0.1)", timeout=3)
    assert out.status == "timeout" and out.error.ename == "KeyboardInterrupt", out
    assert ex(gw, sb, "print(x)").stdout == "41\n"  # interrupted, not restarted


def test_checkpoint_fork_41_42_141_41(gw, sb):
    ex(gw, sb, "f = open('log.txt', 'w'); f.write('before\\n'); f.flush()")
    r = gw.request("POST", f"/api/sandboxes/{sb}/checkpoints", {"name": "x41"})
    assert r.status == 201, r.body
    cp = r.json()
    assert cp["sandbox"] == sb and cp["state_bytes"] > 1 << 20
    assert ex(gw, sb, "x += 1; print(x)").stdout == "42\n"
    fork = gw.request("POST", f"/api/sandboxes/{sb}/fork", {"checkpoint": cp["id"]})
    assert fork.status == 201, fork.body
    fid = fork.json()["id"]
    assert fork.json()["driver"] == gw.driver
    out = ex(gw, fid, "x += 100\nf.write('fork\\n'); f.flush()\nprint(x, open('log.txt').read().split())")
    assert out.stdout == "141 ['before', 'fork']\n", out
    again = gw.request("POST", f"/api/sandboxes/{sb}/fork", {"checkpoint": cp["id"]}).json()["id"]
    assert ex(gw, again, "print(x, open('log.txt').read().split())").stdout == "41 ['before']\n"
    assert ex(gw, sb, "print(x, open('log.txt').read().split())").stdout == "42 ['before']\n"
    # The restored guest's clock is the host's, not the one it was saved with.
    assert abs(float(ex(gw, again, "import time; print(time.time())").stdout) - time.time()) < 5
    for s in (fid, again):
        assert gw.request("DELETE", f"/api/sandboxes/{s}").status == 204
        assert host_processes(s) == []


def test_a_checkpoint_in_place_keeps_the_runtime(gw, sb):
    # A checkpoint either leaves the sandbox where it was (a runsc with --leave-running) or
    # stops it and restores it from the image (a new runtime); both carry on the same state.
    ex(gw, sb, "import threading, time\nticks = [0]\ndef tick():\n    while True:\n        ticks[0] += 1; time.sleep(0.01)\n"
               "threading.Thread(target=tick, daemon=True).start(); y = 7")
    before = gw.request("GET", f"/api/sandboxes/{sb}").json()["runtime_id"]
    r = gw.request("POST", f"/api/sandboxes/{sb}/checkpoints", {"name": "in-place"})
    assert r.status == 201, r.body
    after = gw.request("GET", f"/api/sandboxes/{sb}").json()
    assert after["state"] == "running" and (after["runtime_id"] == before) == gw.in_place, (before, after)
    assert ex(gw, sb, "t = ticks[0]; time.sleep(0.3); print(y, ticks[0] > t)").stdout == "7 True\n"
    assert ("checkpoint %s in" % r.json()["id"]) in gw.log_text()
    assert (f"checkpoint {r.json()['id']} in place" in gw.log_text()) == gw.in_place
    # A fork (a restored sandbox) checkpoints the same way.
    fork = gw.request("POST", f"/api/sandboxes/{sb}/fork", {})
    assert fork.status == 201, fork.body
    fid, before = fork.json()["id"], fork.json()["runtime_id"]
    assert gw.request("POST", f"/api/sandboxes/{fid}/checkpoints", {}).status == 201
    assert (gw.request("GET", f"/api/sandboxes/{fid}").json()["runtime_id"] == before) == gw.in_place
    assert ex(gw, fid, "t = ticks[0]; time.sleep(0.3); print(y, ticks[0] > t)").stdout == "7 True\n"
    assert gw.request("DELETE", f"/api/sandboxes/{fid}").status == 204


def test_pause_frees_the_sandbox_and_resume_keeps_state(gw, sb):
    ex(gw, sb, "f = open('log.txt', 'w'); f.write('before\\n'); f.flush()")
    r = gw.request("POST", f"/api/sandboxes/{sb}/pause", {})
    assert r.status == 200 and r.json()["state"] == "paused", r.body
    assert host_processes(sb) == []  # nothing runs while paused
    out = ex(gw, sb, "x += 1; f.write('after\\n'); f.flush()\n"  # the next call resumes it, open file and all
                     "print(x, open('log.txt').read().split())")
    assert out.stdout == "42 ['before', 'after']\n", out
    assert gw.request("GET", f"/api/sandboxes/{sb}").json()["state"] == "running"
    assert host_processes(sb)


def test_pause_in_memory_stops_the_sandbox_where_it_is(gw, sb):
    ex(gw, sb, "import threading, time\nticks = 0\ndef _tick():\n    global ticks\n    while True:\n"
               "        ticks += 1\n        time.sleep(0.01)\nthreading.Thread(target=_tick, daemon=True).start()")
    ticks = lambda: int(ex(gw, sb, "print(ticks)").stdout)  # noqa: E731
    a, t0 = ticks(), time.monotonic()
    wait_for(lambda: ticks() - a >= 100, timeout=60)  # it counts while it runs
    rate = (ticks() - a) / (time.monotonic() - t0)  # ticks per second, calls included
    a = ticks()
    r = gw.request("POST", f"/api/sandboxes/{sb}/pause", {"mode": "memory"})
    # "frozen" in the core's state machine ("paused" with pause_mode "memory" before it)
    assert r.status == 200 and r.json()["state"] == "frozen" and r.json()["pause_mode"] == "memory", r.body
    assert host_processes(sb)  # memory kept: its processes stay
    # Not a wait for something to happen: an interval in which nothing may (any
    # call would resume the sandbox, so it is watched from outside only).
    frozen_for = 3
    time.sleep(frozen_for)
    r = gw.request("POST", f"/api/sandboxes/{sb}/resume", {})
    assert r.status == 200 and r.json()["state"] == "running" and r.json()["pause_mode"] is None, r.body
    frozen = ticks() - a
    assert frozen < rate * frozen_for / 2, (rate, frozen)  # it did not run while frozen
    # A call on a sandbox paused in memory resumes it, as with a pause to disk.
    assert gw.request("POST", f"/api/sandboxes/{sb}/pause", {"mode": "memory"}).status == 200
    assert ex(gw, sb, "print(x)").stdout == "41\n"
    assert gw.request("GET", f"/api/sandboxes/{sb}").json()["state"] == "running"
    bad = gw.request("POST", f"/api/sandboxes/{sb}/pause", {"mode": "swap"})
    assert bad.status == 400 and "mode" in bad.json()["message"], bad.body


def test_restart_keeps_files_and_drops_variables(gw, sb):
    assert gw.request("POST", f"/api/kernels/{sb}/restart").status == 200
    out = ex(gw, sb, "print('x' in globals(), open('data/in.txt').read())")
    assert out.stdout == "False from the host\n"
    assert ex(gw, sb, "x = 41").status == "ok"  # a restart leaves a kernel that works


def test_a_completion_loads_jedi_and_completes_with_it(gw, sb):
    """The image's kernel (IPython 8.5) starts without jedi and IPython's terminal (less to
    checkpoint and restore); the first complete_request loads jedi and its answer is jedi's
    (a type per match), and IPython.embed is the real function."""
    loaded = "import sys\nprint(sorted(m for m in ('jedi', 'prompt_toolkit', 'debugpy') if m in sys.modules))"
    assert ex(gw, sb, loaded).stdout == "[]\n"
    c = gw.connect(sb)
    code = "import collections\ncollections.Ordered"
    mid = c.send("complete_request", {"code": code, "cursor_pos": len(code)})
    while True:
        m = c.recv(180)
        if m["parent_header"].get("msg_id") == mid and m["msg_type"] == "complete_reply":
            break
    c.close()
    reply = m["content"]
    assert reply["status"] == "ok" and "OrderedDict" in reply["matches"], reply
    types = {t["text"]: t["type"] for t in reply["metadata"]["_jupyter_types_experimental"]}
    assert types["OrderedDict"] == "class", types  # jedi's inference
    assert ex(gw, sb, loaded).stdout == "['jedi']\n"
    out = ex(gw, sb, "import IPython, IPython.terminal.embed as e\nprint(IPython.embed is e.embed)").stdout
    assert out == "True\n"


def test_a_cell_sent_once_the_one_before_failed_runs_however_soon_it_arrives(gw, sb):
    """A failed cell (``stop_on_error``) aborts the requests already waiting in the kernel, not
    one sent after its idle status. Here the kernel stalls right after that idle until the next
    request is in its pipe: ipykernel 6.17's own abort, ended by a timer that runs after the
    loop's next read, aborted it every time (in CI, the stall of a busy machine did it once)."""
    stall = ("import select\n_k = get_ipython().kernel\n_publish = _k._publish_status\n"
             "def _stalling(status, channel, parent=None):\n"
             "    _publish(status, channel, parent)\n"
             "    if status == 'idle' and channel == 'shell' and _k._aborting:\n"
             "        assert select.select([_k.shell_stream.end.fileno()], [], [], 60)[0]\n"
             "_k._publish_status = _stalling\n"
             "print(type(_k.shell_stream).__name__)")
    try:
        assert ex(gw, sb, stall).stdout == "PipeStream\n"
        for _ in range(3):
            failed = ex(gw, sb, "1 / 0")
            assert failed.status == "error" and failed.error.ename == "ZeroDivisionError"
            after = ex(gw, sb, "print('ran')")
            assert (after.status, after.stdout) == ("ok", "ran\n"), (after.status, after.outputs)
    finally:
        assert ex(gw, sb, "if '_publish' in globals(): _k._publish_status = _publish").status == "ok"
    # One already waiting when a cell fails is still aborted, as Jupyter's clients expect. The
    # failing cell waits for it: queued in the kernel, or in the pipe (nothing reads it while a cell runs).
    fail_once_next_is_in = ("import select, time\nk = get_ipython().kernel\nend = time.monotonic() + 60\n"
                            "while not k.msg_queue.qsize() and not select.select([k.shell_stream.end], [], [], 0.05)[0]:\n"
                            "    assert time.monotonic() < end, 'no next request'\n"
                            "1 / 0")
    c = gw.connect(sb)
    first = c.send("execute_request", {"code": fail_once_next_is_in, "silent": False})
    queued = c.send("execute_request", {"code": "print('queued')", "silent": False})
    replies = {}
    while len(replies) < 2:
        m = c.recv(120)
        if m["msg_type"] == "execute_reply":
            replies[m["parent_header"]["msg_id"]] = m["content"]["status"]
    assert replies == {first: "error", queued: "aborted"}
    # The sandbox API's execute says so too, with an error that names it.
    running = c.send("execute_request", {"code": fail_once_next_is_in, "silent": False})
    while True:  # it runs: what comes now waits behind it
        m = c.recv(120)
        if m["msg_type"] == "execute_input" and m["parent_header"]["msg_id"] == running:
            break
    seen = []
    behind = gw.sandbox(sb).run_code("print('behind')", timeout=120, on_error=seen.append)
    c.close()
    assert behind.status == "aborted" and behind.stdout == "" and behind.error.ename == "Aborted", behind.error
    assert seen == [behind.error]
    assert "did not run this cell" in behind.error.evalue


def test_output_flood_keeps_the_gateway_responsive(gw, sb):
    c = gw.connect(sb)
    mid = c.send("execute_request", {"code": "import sys\nfor i in range(20000): sys.stdout.write('y' * 999 + '\\n')",
                                     "silent": False, "store_history": False, "user_expressions": {}})
    assert gw.request("GET", "/api/kernels").status == 200  # while the flood is on
    got, idle = 0, False
    while not idle:
        m = c.recv(180)
        if m["parent_header"].get("msg_id") != mid:
            continue
        if m["msg_type"] == "stream":
            got += len(m["content"]["text"])
        idle = m["msg_type"] == "status" and m["content"]["execution_state"] == "idle"
    c.close()
    assert got == 20000 * 1000  # every byte, in order of arrival
    assert ex(gw, sb, "print(1 + 1)").stdout == "2\n"


def test_guest_killed_from_outside_is_reported_and_recovered(gw, sb):
    runtime = gw.request("GET", f"/api/sandboxes/{sb}").json()["runtime_id"]
    assert gw.driver != "gvisor" or os.geteuid() != 0 or cgroups_of(runtime)  # (rootless runsc makes none)
    procs = host_processes(sb)
    assert procs
    for p in procs:
        p.kill()
    info = wait_for(lambda: (lambda i: i if i["execution_state"] == "dead" else None)(
        gw.request("GET", f"/api/sandboxes/{sb}").json()), timeout=60)
    assert info["reason"], info  # says why, e.g. "VM was killed (SIGKILL)"
    wait_for(lambda: not (gw.home / "sandboxes" / sb).exists(), timeout=30)  # its leftovers are removed
    # ... runsc's record and cgroups too (its pids may still be zombies when the gateway cleans up)
    record = gw.home / "runtime" / "gvisor" / f"{runtime}_sandbox:{runtime}.state"
    wait_for(lambda: not cgroups_of(runtime) and not record.exists(), timeout=30)
    r = gw.request("POST", f"/api/sandboxes/{sb}/execute", {"code": "1"})
    assert r.status in (409, 500) and "dead" in r.json()["message"], r.body
    assert gw.request("POST", f"/api/kernels/{sb}/restart").status == 200  # a new sandbox, same workspace
    assert ex(gw, sb, "print(open('data/in.txt').read())").stdout == "from the host\n"


def test_memory_limit_holds(gw):
    s = create(gw, limits={"memory_mb": 200})["id"]
    runtime = gw.request("GET", f"/api/sandboxes/{s}").json()["runtime_id"]
    try:
        r = gw.request("POST", f"/api/sandboxes/{s}/execute", {"code": "b = bytearray(300 << 20)\nprint('allocated')"})
        body = r.json()
        # gVisor's cgroup kills the sandbox; a VM's own kernel refuses the allocation.
        assert "allocated" not in body.get("stdout", ""), body
        assert r.status == 200 and body["status"] == "error", body
        if body["error"]["ename"] != "MemoryError":
            assert body["error"]["ename"] == "DeadKernelError", body
            info = wait_for(lambda: (lambda i: i if i["execution_state"] == "dead" else None)(
                gw.request("GET", f"/api/sandboxes/{s}").json()), timeout=60)
            assert "memory" in info["reason"] or "killed" in info["reason"], info
            wait_for(lambda: not cgroups_of(runtime), timeout=30)  # nothing of it is left (runsc delete ran)
        assert gw.request("GET", "/api").status == 200
        assert gw.request("POST", f"/api/kernels/{s}/restart").status == 200
        assert ex(gw, s, "print(1 + 1)").stdout == "2\n"
    finally:
        gw.request("DELETE", f"/api/sandboxes/{s}")


def test_delete_leaves_nothing_behind(gw, sb):
    runtime = gw.request("GET", f"/api/sandboxes/{sb}").json()["runtime_id"]
    handles = [socket_dir(gw.home, runtime, kind) for kind in "gq"]
    assert any(d.is_dir() for d in handles)
    assert gw.request("DELETE", f"/api/sandboxes/{sb}").status == 204
    assert gw.request("GET", f"/api/sandboxes/{sb}").status == 404
    assert host_processes(sb) == []
    assert not (gw.home / "sandboxes" / sb).exists() and not (gw.home / "workspaces" / sb).exists()
    # The runtime's sockets and handles live outside the home (a unix socket path is short): gone too.
    assert not any(d.exists() for d in handles)


def test_a_checkpoint_is_refused_up_front_without_the_disk_for_it(tmp_path):
    """The check every driver makes before it stops anything (runsc stops the sandbox even when
    writing its image fails; tests/test_checkpoints.py fills a real disk)."""
    from sandgate.drivers.base import SandboxError, require_disk_for_checkpoint

    st = os.statvfs(tmp_path)
    require_disk_for_checkpoint(tmp_path, 1 << 20)
    with pytest.raises(SandboxError, match=r"not enough disk space for a checkpoint: \d+ MB free in "
                                           rf"{re.escape(str(tmp_path))}, up to \d+ MB needed"):
        require_disk_for_checkpoint(tmp_path, st.f_bavail * st.f_frsize + (1 << 30))


def test_a_runsc_record_naming_a_zombie_is_acted_on_and_one_naming_a_stranger_is_not(tmp_path):
    """`runsc delete` SIGKILLs the pids runsc recorded, unchecked. A zombie (the Sentry that just
    ended, not yet reaped) takes no harm from it: its record and cgroups are deleted. A live process
    that is not the sandbox's is left alone (in-process; the real case is the stale-record test)."""
    import json
    import subprocess

    from sandgate.drivers.gvisor import GVisorDriver

    drv = GVisorDriver(str(tmp_path / "home" / "runtime" / "gvisor"), Settings.load())
    zombie, stranger = subprocess.Popen(["true"]), subprocess.Popen(["sleep", "300"])
    try:
        wait_for(lambda: Path(f"/proc/{zombie.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z", timeout=30)

        def names_its_sandbox(pid):
            drv._record("sg-x").write_text(json.dumps({"goferPid": pid, "sandbox": {"pid": None},
                                                       "bundleDir": str(tmp_path / "bundle")}))
            return drv._names_its_sandbox("sg-x")

        assert names_its_sandbox(zombie.pid) is True
        assert names_its_sandbox(stranger.pid) is False
        assert names_its_sandbox(2) is False  # a kernel thread (kthreadd): some take SIGKILL
    finally:
        stranger.kill()
        stranger.wait()
        zombie.wait()


def test_cgroups_runsc_made_before_it_recorded_a_sandbox_go_with_the_runtime(tmp_path):
    """A runtime torn down after runsc made its cgroups but before runsc recorded it has no
    record for `runsc delete` to act on: the driver's delete (at destroy) and its reap (at the
    next gateway's start, which finds the runtime's socket directory) remove the cgroups."""
    from test_shim import make_cgroups

    from sandgate.drivers.base import SandboxSpec
    from sandgate.drivers.gvisor import GVisorDriver, cgroup_name

    drv = GVisorDriver(str(tmp_path / "home" / "runtime" / "gvisor"), Settings.load())
    destroyed, left, planted = (f"sg-drvtest-{os.urandom(4).hex()}" for _ in range(3))
    made = make_cgroups(cgroup_name(destroyed)) + make_cgroups(cgroup_name(left))
    kept = make_cgroups(cgroup_name(planted))
    for runtime, mode in ((left, 0o700), (planted, 0o755)):  # 0755: not a directory the driver made
        sockets = socket_dir(drv.home, runtime, "g")
        sockets.mkdir()
        sockets.chmod(mode)
        spec = SandboxSpec(id=runtime, rootfs=tmp_path, agent_dir=tmp_path, workspace=tmp_path, state_dir=tmp_path)
        (sockets / "spec.json").write_text(spec.model_dump_json())
    try:
        assert not drv._record(destroyed).exists()
        asyncio.run(drv.delete(destroyed))
        assert [d.name for d in made if d.exists()] == [left] * (len(made) // 2)
        assert asyncio.run(drv.reap()) == 0  # runsc has no record of any
        assert not [d for d in made if d.exists()] and not socket_dir(drv.home, left, "g").exists()
        assert all(d.exists() for d in kept)  # named only by a directory anyone could have made
    finally:
        made += kept
        for d in made:
            if d.exists():
                d.rmdir()


def test_reclaim_is_off_for_a_rootless_runsc_unless_asked_for():
    from sandgate.drivers.gvisor import reclaim_enabled

    debian12, debian13 = 20221219, 20240729
    assert reclaim_enabled("auto", rootless=False, runsc_date=debian12)
    assert not reclaim_enabled("auto", rootless=True, runsc_date=debian12)  # the Sentry keeps /proc mounted there
    assert not reclaim_enabled("auto", rootless=False, runsc_date=debian13)  # directfs: not verified
    assert not reclaim_enabled("auto", rootless=False, runsc_date=0)  # a runsc of unknown date
    assert reclaim_enabled("true", rootless=True, runsc_date=debian13) and reclaim_enabled(" ON ", True, 0)
    assert not reclaim_enabled("false", rootless=False, runsc_date=debian12)
    assert reclaim_enabled("", False, debian12) and not reclaim_enabled("tru", False, debian13)  # else: auto


def test_a_restored_gvisor_sandbox_hands_its_restore_heap_back_when_asked(home, tmp_path):
    """SANDGATE_RUNSC_RECLAIM=true: runsc runs with --profile and, once a restore
    is running, the driver runs the Sentry's GC; the sandbox works on as before.
    (How much memory it gives back is the density bench's to measure.)"""
    from conftest import Gateway

    g = Gateway(home, tmp_path, env={"SANDGATE_RUNSC_RECLAIM": "true", "SANDGATE_WARM_START": "true"})
    try:
        sid = g.create(driver="gvisor")["id"]
        assert ex(g, sid, "x = 2").status == "ok"
        cp = g.request("POST", f"/api/sandboxes/{sid}/checkpoints", {"name": "two"})
        assert cp.status == 201, cp.body
        fork = g.request("POST", f"/api/sandboxes/{sid}/fork", {"checkpoint": cp.json()["id"]})
        assert fork.status == 201, fork.body  # a fork is always a restore
        fid = fork.json()["id"]
        started = re.search(rf"sandbox {fid} started \(gvisor, runtime (\S+),", g.log_text())
        assert started, g.log_text()[-3000:]
        runtime = started.group(1)
        wait_for(lambda: f"sandbox {runtime}: restore heap reclaimed" in g.log_text(), timeout=120)
        assert f"sandbox {runtime}: restore heap not reclaimed" not in g.log_text()
        assert ex(g, fid, "print(x + 2)").stdout == "4\n"
        # runsc debug removes the file it was given when the RPC fails: it must never be a shared one.
        assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
        assert not (socket_dir(g.home, runtime, "g") / "heap.prof").exists()
        if os.geteuid() == 0:
            sentry_has_nothing_to_open(fid)
    finally:
        g.stop()


def sentry_has_nothing_to_open(sid):
    """What makes `--profile` safe as root: the one rule it adds to the Sentry's
    seccomp filter is a read-only openat, and the Sentry has nothing to open:
    it runs as nobody in a read-only tmpfs root with no /proc."""
    sentries = [p for p in host_processes(sid) if p.cmdline()[:1] == ["runsc-sandbox"]]
    assert sentries, [p.cmdline()[:2] for p in host_processes(sid)]
    for p in sentries:
        status = Path(f"/proc/{p.pid}/status").read_text()
        assert re.search(r"^Uid:\s+65534\s", status, re.M), status
        assert re.search(r"^Seccomp:\s+2$", status, re.M), status
        mounts = Path(f"/proc/{p.pid}/mountinfo").read_text().splitlines()
        assert [m.split()[4] for m in mounts] == ["/"] and " - tmpfs " in mounts[0] and " ro," in mounts[0], mounts
        held = [os.readlink(f"/proc/{p.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{p.pid}/fd")]
        dirs = [h for h in held if h.startswith("/") and os.path.isdir(h)]
        assert dirs == [], held  # no host directory for an openat to start from


def test_a_gvisor_sandbox_that_ends_while_no_gateway_runs_leaves_no_runsc_record_or_process(home, tmp_path):
    """runsc runs detached, so no runsc process is there to clean up when the
    sandbox ends, and no gateway either once it was killed: the shim does (kills
    what is left, runs `runsc delete`). A record left behind would name pids that
    the next gateway's `runsc delete` SIGKILLs unchecked, whoever has them by then."""
    import signal
    import subprocess

    from conftest import Gateway

    g = Gateway(home, tmp_path, env={"SANDGATE_WARM_START": "false"})
    try:
        sid = g.create(driver="gvisor")["id"]
        runtime = g.request("GET", f"/api/sandboxes/{sid}").json()["runtime_id"]
        sockets = socket_dir(g.home, runtime, "g")
        shim = psutil.Process(int((sockets / "shim.pid").read_text()))
        sentry = psutil.Process(int((sockets / "sandbox.pid").read_text()))
        assert runtime in " ".join(sentry.cmdline()) and sentry.ppid() == shim.pid  # the shim is its parent
        g.proc.kill()  # no gateway from here on
        g.proc.wait()
        sentry.kill()  # the sandbox ends
        shim.wait(timeout=60)  # (not its child here: psutil has no exit status for it)
        assert (sockets / "status").read_text() == str(-signal.SIGKILL)  # the Sentry's, as the shim saw it
        listed = subprocess.run(["runsc", "--root", str(g.home / "runtime" / "gvisor"), "list", "-quiet"],
                                input="", capture_output=True, text=True, timeout=60)
        assert listed.returncode == 0 and runtime not in listed.stdout.split(), listed
        assert not host_processes(runtime)  # the gofer neither
    finally:
        g.stop()
        # Its workspace stays mounted for the next gateway (the record lives on, dead); there
        # is none here, so the test takes the mount and its loop device down itself.
        asyncio.run(reap_mounts(g.home / "workspaces"))


def test_a_stale_runsc_record_naming_another_process_is_left_alone(home, tmp_path):
    """A sandbox whose shim and gateway were both killed, and which then ended, leaves runsc's
    record behind; by the next start its pids may be other processes', which `runsc delete`
    would SIGKILL unchecked. The next gateway leaves such a record alone and says so."""
    import json
    import subprocess

    from conftest import Gateway

    g = Gateway(home, tmp_path, env={"SANDGATE_WARM_START": "false"})
    stranger = subprocess.Popen(["sleep", "300"])
    runtime = None
    try:
        sid = g.create(driver="gvisor")["id"]
        runtime = g.request("GET", f"/api/sandboxes/{sid}").json()["runtime_id"]
        g.proc.kill()
        g.proc.wait()
        for p in host_processes(runtime):  # shim, Sentry, gofer: nobody is left to clean up
            p.kill()
        wait_for(lambda: not host_processes(runtime), timeout=30)
        record = g.home / "runtime" / "gvisor" / f"{runtime}_sandbox:{runtime}.state"
        state = json.loads(record.read_text())
        state["sandbox"]["pid"] = stranger.pid  # as if that pid had been reused
        record.write_text(json.dumps(state))
        g2 = Gateway(home, tmp_path, env={"SANDGATE_WARM_START": "false"}, own_home=g.home)
        try:
            # (it may name the gofer's pid first: on a busy host that one can be taken within seconds)
            wait_for(lambda: f"runsc's record of {runtime} names pid " in g2.log_text(), timeout=120)
            assert stranger.poll() is None  # not killed
            assert g2.request("GET", "/api").status == 200
        finally:
            g2.stop()
    finally:
        stranger.kill()
        stranger.wait()
        g.stop()
        # What the warning tells a person to do once that process is gone: the record and cgroups go.
        if runtime:
            subprocess.run(["runsc", "--root", str(g.home / "runtime" / "gvisor"), "delete", "--force", runtime],
                           capture_output=True, timeout=60)
            wait_for(lambda: not cgroups_of(runtime), timeout=30)
