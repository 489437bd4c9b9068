"""Lifecycle races and failures a hostile user can provoke, against a real gateway
and real gVisor sandboxes.

- io_uring: an io_uring descriptor makes this runsc's next checkpoint kill the
  sandbox, so io_uring is refused, and a checkpoint that fails answers what
  became of the sandbox (a runsc that kills it, played by a wrapper), never
  that it runs on.
- kills and races: a SIGKILL of the gateway mid-resume brings a paused sandbox
  back paused, not dead; one mid-DELETE leaves it gone, not dead; a resume (or
  restart) that loses a race to a DELETE is a 404, not 200 "deleted" or a 500.
- execute across a pause: a pause while `POST .../execute` waits must not end
  the call in a silent timeout; the cell's output arrives across the pause and
  resume, and a call whose sandbox is still paused at its deadline says so.
- egress: a PATCH of /egress that fails (503) leaves the record as it was, and
  on a dead sandbox it is a 409.

The windows for a kill or a race are made, never waited out: the sandbox's shim
is stopped (SIGSTOP), so a DELETE waits in its teardown (up to 10 s, the
gateway's own bound) once it has killed the sandbox, which the test sees as the
Sentry left a zombie; a resume from disk is killed once its `runsc restore` runs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from pathlib import Path

import psutil
import pytest

from conftest import Gateway, host_processes, wait_for
from sandgate.drivers.base import socket_dir

RUNSC = "/usr/bin/runsc"
WRAPPER = """#!/bin/bash
# runsc, except that a checkpoint of the runtime {marker} names kills that sandbox (SIGKILL to its
# Sentry, as a panic would end it) and fails: the shape of this runsc's death by io_uring.
args=("$@")
for i in "${{!args[@]}}"; do
  if [ "${{args[$i]}}" = checkpoint ] && [ "$(cat "{marker}" 2>/dev/null)" = "${{args[-1]}}" ]; then
    rm -f "{marker}"
    pid=$("{runsc}" "${{args[@]:0:$i}}" state "${{args[-1]}}" | python3 -c 'import json, sys; print(json.load(sys.stdin)["pid"])')
    kill -KILL "$pid"
    echo "panic: test: the sandbox died in its checkpoint" >&2
    exit 1
  fi
done
exec "{runsc}" "$@"
"""


@pytest.fixture(scope="module")
def gw(home, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hostile-lifecycle")
    marker = tmp / "kill-at-next-checkpoint"
    wrapper = tmp / "runsc"
    wrapper.write_text(WRAPPER.format(marker=marker, runsc=RUNSC))
    wrapper.chmod(0o755)
    g = Gateway(home, tmp, env={"SANDGATE_RUNSC": str(wrapper), "SANDGATE_MAX_KERNELS": "6"})
    g.marker = marker
    yield g
    g.stop()


def create(g: Gateway, **body) -> str:
    r = g.request("POST", "/api/sandboxes", body)
    assert r.status == 201, r.body
    return r.json()["id"]


def state(g: Gateway, sid: str) -> dict:
    return g.request("GET", f"/api/sandboxes/{sid}").json()


def execute(g: Gateway, sid: str, code: str, timeout: float = 60) -> dict:
    r = g.request("POST", f"/api/sandboxes/{sid}/execute", {"code": code, "timeout": timeout})
    assert r.status == 200, r.body
    return r.json()


def sockets(g: Gateway, sid: str) -> Path:
    return socket_dir(g.home, state(g, sid)["runtime_id"], "g")


def zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class StuckDelete:
    """A DELETE held in its teardown: the sandbox's shim is stopped, so once the DELETE has
    killed the sandbox (its Sentry a zombie the stopped shim cannot reap) the gateway waits
    for the shim, up to its 10 s bound. ``answer`` is the DELETE's response, once it came."""

    def __init__(self, g: Gateway, sid: str):
        self.g, self.sid = g, sid
        d = sockets(g, sid)
        self.shim = int((d / "shim.pid").read_text())
        sentry = int((d / "sandbox.pid").read_text())
        os.kill(self.shim, signal.SIGSTOP)
        self.answer = None
        self.thread = threading.Thread(target=self._delete, daemon=True)
        self.thread.start()
        wait_for(lambda: zombie(sentry), timeout=60, interval=0.02)

    def _delete(self):
        try:
            self.answer = self.g.request("DELETE", f"/api/sandboxes/{self.sid}")
        except OSError:
            pass  # the gateway was killed under it

    def release(self):
        try:
            os.kill(self.shim, signal.SIGCONT)
        except ProcessLookupError:
            pass


# -- io_uring and a checkpoint that kills the sandbox -----------------------------------
IO_URING = """
import ctypes, errno
libc = ctypes.CDLL(None, use_errno=True)
params = ctypes.create_string_buffer(120)
got = []
for nr, args in ((425, (8, params)), (426, (0, 1, 0, 0, None, 0)), (427, (0, 0, None, 0))):
    ctypes.set_errno(0)
    r = libc.syscall(nr, *args)
    got.append(f"{r} {errno.errorcode.get(ctypes.get_errno(), ctypes.get_errno())}")
print(", ".join(got))
"""


def test_io_uring_is_refused_and_checkpoints_go_on(gw):
    sid = create(gw)
    try:
        out = execute(gw, sid, IO_URING)
        assert out["stdout"] == "-1 EPERM, -1 EPERM, -1 EPERM\n", out  # allowed, it answers "43 0, -1 EBADF, -1 ENOSYS"
        r = gw.request("POST", f"/api/sandboxes/{sid}/checkpoints", {})
        assert r.status == 201, r.body
        assert state(gw, sid)["state"] == "running"
        assert execute(gw, sid, "print(1 + 1)")["stdout"] == "2\n"
    finally:
        gw.request("DELETE", f"/api/sandboxes/{sid}")


def test_a_checkpoint_that_kills_the_sandbox_answers_that_it_died(gw):
    sid = create(gw)
    try:
        execute(gw, sid, "x = 1")
        gw.marker.write_text(state(gw, sid)["runtime_id"])  # its next runsc checkpoint kills it and fails
        r = gw.request("POST", f"/api/sandboxes/{sid}/checkpoints", {})
        assert r.status == 503, r.body
        message = r.json()["message"]
        assert "runs on" not in message and "died" in message, message
        assert "the sandbox died in its checkpoint" in message, message  # runsc's own words
        info = state(gw, sid)  # at once: the answer was already true
        assert info["state"] == "dead" and "the sandbox died in its checkpoint" in info["reason"], info
        # As any dead sandbox: a restart revives it over its files.
        assert gw.request("POST", f"/api/kernels/{sid}/restart", {}).status == 200
        assert execute(gw, sid, "print(2)")["stdout"] == "2\n"
    finally:
        gw.marker.unlink(missing_ok=True)
        gw.request("DELETE", f"/api/sandboxes/{sid}")


# -- kills and races around resume and delete -------------------------------------------
def test_a_resume_or_restart_that_loses_a_race_to_a_delete_is_a_404(gw):
    sid = create(gw)
    stuck = StuckDelete(gw, sid)  # the DELETE has killed the sandbox and waits for its shim
    answers = {}

    def call(name, method, path):
        answers[name] = gw.request(method, path, {})

    calls = [threading.Thread(target=call, args=("resume", "POST", f"/api/sandboxes/{sid}/resume")),
             threading.Thread(target=call, args=("restart", "POST", f"/api/kernels/{sid}/restart"))]
    for t in calls:
        t.start()
    for t in calls:
        t.join(120)
    stuck.thread.join(120)
    stuck.release()
    assert stuck.answer is not None and stuck.answer.status == 204, stuck.answer and stuck.answer.body
    for name, r in answers.items():
        assert r.status == 404 and sid in r.json()["message"], (name, r.status, r.body)
    assert gw.request("GET", f"/api/sandboxes/{sid}").status == 404


def kill9(g: Gateway) -> None:
    g.proc.send_signal(signal.SIGKILL)
    g.proc.wait()
    g.log.close()


def runsc_list(g: Gateway) -> set:
    out = subprocess.run([RUNSC, "--root", str(g.home / "runtime" / "gvisor"), "list", "-quiet"],
                         capture_output=True, text=True).stdout
    return set(out.split())


def test_a_gateway_killed_mid_resume_brings_the_sandbox_back_paused(home, tmp_path):
    env = {"SANDGATE_KEEP_SANDBOXES": "true", "SANDGATE_WARM_START": "false"}
    g = Gateway(home, tmp_path, env=env)
    sid = create(g)
    execute(g, sid, "x = 41")
    assert g.request("POST", f"/api/sandboxes/{sid}/pause", {}).json()["state"] == "paused"
    image = g.home / "paused" / sid

    def resume():
        try:
            g.request("POST", f"/api/sandboxes/{sid}/resume", {}, timeout=30)
        except OSError:
            pass  # the gateway is killed under it

    t = threading.Thread(target=resume, daemon=True)

    def restoring():  # the resume's `runsc restore` of the paused image runs: the record says resuming
        return [p for p in host_processes(str(image)) if "restore" in p.info["cmdline"]]

    t.start()
    wait_for(restoring, timeout=60, interval=0.01)
    kill9(g)
    # The orphaned restore goes on without the gateway: the next one is started once it is done.
    wait_for(lambda: not [p for p in restoring() if "--detach" in p.info["cmdline"] and
                          not p.info["cmdline"][0].endswith("python3") and "shim.py" not in " ".join(p.info["cmdline"])],
             timeout=120)
    g2 = Gateway(home, tmp_path, own_home=g.home, env=env)
    try:
        info = state(g2, sid)
        assert info["state"] == "paused" and info["pause_mode"] == "disk", info
        assert image.is_dir()
        assert execute(g2, sid, "print(x + 1)")["stdout"] == "42\n"  # its running state, not a checkpoint's
        assert not image.exists()  # consumed by the resume
        assert g2.request("DELETE", f"/api/sandboxes/{sid}").status == 204
    finally:
        g2.stop()


def test_a_gateway_killed_mid_delete_finishes_the_delete_at_its_next_start(home, tmp_path):
    env = {"SANDGATE_KEEP_SANDBOXES": "true", "SANDGATE_WARM_START": "false"}
    g = Gateway(home, tmp_path, env=env)
    sid = create(g)
    execute(g, sid, "open('file.txt', 'w').write('x')")
    runtime = state(g, sid)["runtime_id"]
    stuck = StuckDelete(g, sid)
    kill9(g)  # mid-DELETE: the sandbox is killed, its files and record not yet removed
    stuck.release()  # the shim carries on as it would have, and ends with its sandbox
    wait_for(lambda: not psutil.pid_exists(stuck.shim) or zombie(stuck.shim), timeout=60)
    g2 = Gateway(home, tmp_path, own_home=g.home, env=env)
    try:
        r = g2.request("GET", f"/api/sandboxes/{sid}")
        assert r.status == 404, r.body  # gone, as the DELETE asked; not "dead"
        assert sid not in [s["id"] for s in g2.request("GET", "/api/sandboxes").json()]
        ws = g2.home / "workspaces"
        assert not (ws / sid).exists() and not (ws / f"{sid}.img").exists()
        assert not (g2.home / "sandboxes" / sid).exists()
        assert runtime not in runsc_list(g2)
        assert not socket_dir(g2.home, runtime, "g").exists()
    finally:
        g2.stop()


# -- an execute across a pause ------------------------------------------------------------
CELL = ("import os, time\nprint('before', flush=True)\nopen('started', 'w').close()\n"
        "while not os.path.exists('go'):\n    time.sleep(0.05)\nos.remove('go')\nos.remove('started')\nprint('after')")


def test_an_execute_waits_across_a_pause_and_resume_and_says_so_when_still_paused(gw):
    sid = create(gw)
    started = gw.home / "workspaces" / sid / "started"
    try:
        for mode in ("disk", "memory"):
            result = {}
            t = threading.Thread(target=lambda: result.update(r=execute(gw, sid, CELL, timeout=120)))
            t.start()
            wait_for(started.exists, timeout=60, interval=0.05)
            assert gw.request("POST", f"/api/sandboxes/{sid}/pause", {"mode": mode}).status == 200
            assert gw.request("POST", f"/api/sandboxes/{sid}/resume", {}).json()["state"] == "running"
            assert gw.request("PUT", f"/api/sandboxes/{sid}/files/go", raw=b"").status == 201
            t.join(120)
            out = result["r"]
            assert out["status"] == "ok" and out["stdout"] == "before\nafter\n", (mode, out)

        # Paused past the call's timeout: answered at its deadline, saying the cell was kept, not lost.
        result = {}
        t = threading.Thread(target=lambda: result.update(r=execute(gw, sid, CELL, timeout=15)))
        t.start()
        wait_for(started.exists, timeout=60, interval=0.05)
        assert gw.request("POST", f"/api/sandboxes/{sid}/pause", {}).json()["state"] == "paused"
        t.join(120)
        out = result["r"]
        assert out["status"] == "timeout" and out["stdout"] == "before\n", out
        assert out["error"] and out["error"]["ename"] == "SandboxPaused", out
        assert "paused" in out["error"]["evalue"] and "not interrupted" in out["error"]["evalue"], out
        assert state(gw, sid)["state"] == "paused"
        # The cell is in the paused state: it ends after the resume, and the kernel goes on.
        assert gw.request("PUT", f"/api/sandboxes/{sid}/files/go", raw=b"").status == 201  # resumes it
        assert execute(gw, sid, "print('next')")["stdout"] == "next\n"
        assert not started.exists()
    finally:
        gw.request("DELETE", f"/api/sandboxes/{sid}")


# -- a failed or refused egress patch ------------------------------------------------------
SQUAT = ("import socket\nsquat = socket.socket()\nsquat.bind(('127.0.0.1', 3128))\nsquat.listen()\n"
         "print('squatting')")


def test_a_failed_or_refused_egress_patch_changes_nothing(gw):
    sid = create(gw)
    try:
        # The sandbox's user holds the port the agent's egress listener needs: the PATCH fails.
        assert execute(gw, sid, SQUAT)["stdout"] == "squatting\n"
        r = gw.request("PATCH", f"/api/sandboxes/{sid}/egress", {"allow": ["example.com"]})
        assert r.status == 503 and "egress" in r.json()["message"], r.body
        assert state(gw, sid)["egress"] is None
        assert gw.request("GET", f"/api/sandboxes/{sid}/egress").json() is None
        assert execute(gw, sid, "import os\nprint(os.environ.get('HTTPS_PROXY'))")["stdout"] == "None\n"

        execute(gw, sid, "squat.close()")
        r = gw.request("PATCH", f"/api/sandboxes/{sid}/egress", {"allow": ["example.com"]})
        assert r.status == 200 and r.json()["egress"]["allow"] == ["example.com"], r.body

        runtime = state(gw, sid)["runtime_id"]
        subprocess.run([RUNSC, "--root", str(gw.home / "runtime" / "gvisor"), "kill", runtime, "KILL"], check=False)
        wait_for(lambda: state(gw, sid)["state"] == "dead", 60)
        r = gw.request("PATCH", f"/api/sandboxes/{sid}/egress", {"allow": ["other.example.com"]})
        assert r.status == 409 and r.json()["state"] == "dead", r.body
        assert state(gw, sid)["egress"]["allow"] == ["example.com"]
    finally:
        gw.request("DELETE", f"/api/sandboxes/{sid}")
