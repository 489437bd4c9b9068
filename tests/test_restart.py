"""Nothing is lost to the gateway's own lifecycle, end to end with real
sandboxes: a SIGTERM pauses every sandbox to disk and the next `serve` on that
home resumes each with its running state; after a SIGKILL a sandbox comes back
from its newest checkpoint or is reported dead with the reason; cells sent
over a websocket while a checkpoint runs all run, in order. The same races
run in-process, in seconds, in unit/test_lifecycle.py."""

from __future__ import annotations

import signal
import subprocess
import threading
import time

import pytest

from conftest import Gateway, wait_for

KEEP = {"SANDGATE_KEEP_SANDBOXES": "true"}


def ex(gw, sid, code):
    return gw.run_code(sid, code)  # the SDK (conftest)


def again(gw: Gateway, home, tmp_path, env=None) -> Gateway:
    """The next `serve` on the same home."""
    return Gateway(home, tmp_path, own_home=gw.home, env=env)


@pytest.mark.parametrize("driver", ["gvisor", "qemu"])
def test_sigterm_pauses_everything_and_the_next_gateway_resumes_it(driver, home, tmp_path):
    if driver == "qemu":
        from sandgate_images import vm

        vm.build(home)
    env = {**KEEP, "SANDGATE_WARM_START": "false" if driver == "qemu" else "true"}
    g = Gateway(home, tmp_path, env=env)
    try:
        kid = g.create(driver=driver)["id"]
        c = g.connect(kid)
        assert c.execute("x = 41")["reply"]["status"] == "ok"
        c.close()
        other = g.create(driver=driver)["id"]
        ex(g, other, "y = 'paused before'")
        assert g.request("POST", f"/api/sandboxes/{other}/pause").json()["state"] == "paused"
    finally:
        g.stop()  # SIGTERM
    log = g.log_text()
    assert f"shutdown: 1/1: sandbox {kid} paused" in log, log[-3000:]
    g2 = again(g, home, tmp_path, env=env)
    try:
        listed = {s["id"]: s for s in g2.request("GET", "/api/sandboxes").json()}
        assert listed[kid]["state"] == "paused" and listed[other]["state"] == "paused", listed
        assert g2.request("GET", f"/api/kernels/{kid}").json()["execution_state"] == "paused"
        c = g2.connect(kid)  # the same kernel id, over the Jupyter websocket
        assert c.execute("x + 1")["results"][0]["text/plain"] == "42"
        c.close()
        assert ex(g2, other, "print(y)").stdout == "paused before\n"
        assert g2.request("GET", f"/api/sandboxes/{kid}").json()["state"] == "running"
        for sid in (kid, other):
            assert g2.request("DELETE", f"/api/sandboxes/{sid}").status == 204
    finally:
        g2.stop()


def kill9(g: Gateway) -> None:
    g.proc.send_signal(signal.SIGKILL)
    g.proc.wait()
    g.log.close()


def runtimes(g: Gateway, driver: str) -> set:
    """The runtimes of this gateway's home that are alive on the host."""
    if driver == "gvisor":
        out = subprocess.run(["runsc", "--root", str(g.home / "runtime" / "gvisor"), "list", "-quiet"],
                             capture_output=True, text=True).stdout
        return {line for line in out.split() if line.startswith("sg-")}
    out = subprocess.run(["pgrep", "-af", "qemu-system-x86_64"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if str(g.home) in line or "sgq-" in line}


@pytest.mark.parametrize("driver", ["gvisor", "qemu"])
def test_after_sigkill_running_and_frozen_sandboxes_are_adopted_with_their_state(driver, home, tmp_path):
    if driver == "qemu":
        from sandgate_images import vm

        vm.build(home)
    env = {**KEEP, "SANDGATE_WARM_START": "false"}
    g = Gateway(home, tmp_path, env=env)
    running = g.create(driver=driver)["id"]
    ex(g, running, "x = 41")
    frozen = g.create(driver=driver)["id"]
    ex(g, frozen, "y = 'in memory'")
    assert g.request("POST", f"/api/sandboxes/{frozen}/pause", {"mode": "memory"}).json()["state"] == "frozen"
    before = {s["id"]: s["runtime_id"] for s in g.request("GET", "/api/sandboxes").json()}
    kill9(g)  # no checkpoint anywhere: only the live runtimes hold x and y
    g2 = again(g, home, tmp_path, env=env)
    try:
        listed = {s["id"]: s for s in g2.request("GET", "/api/sandboxes").json()}
        assert listed[running]["state"] == "running" and listed[frozen]["state"] == "frozen", listed
        assert {i: s["runtime_id"] for i, s in listed.items()} == before  # the same runtimes, not new ones
        assert "reason" not in listed[running] or not listed[running]["reason"]
        assert f"sandbox {running}: adopted its running runtime" in g2.log_text()
        c = g2.connect(running)  # over the Jupyter websocket, as before the crash
        assert c.execute("x + 1")["results"][0]["text/plain"] == "42"
        c.close()
        assert g2.request("POST", f"/api/sandboxes/{frozen}/resume").json()["state"] == "running"
        assert ex(g2, frozen, "print(y)").stdout == "in memory\n"
        # Adopted runtimes are this gateway's like any other: a checkpoint and a delete work.
        assert g2.request("POST", f"/api/sandboxes/{running}/checkpoints", {}).status == 201
        assert ex(g2, running, "print(x)").stdout == "41\n"
        for sid in (running, frozen):
            assert g2.request("DELETE", f"/api/sandboxes/{sid}").status == 204
        wait_for(lambda: not runtimes(g2, driver), timeout=30)
    finally:
        g2.stop()


def test_after_sigkill_with_its_runtime_gone_a_sandbox_resumes_from_its_newest_checkpoint_or_is_dead(home, tmp_path):
    g = Gateway(home, tmp_path, env=KEEP)
    saved = g.create()["id"]
    ex(g, saved, "x = 41\nopen('kept.txt', 'w').write('files too')")
    cp = g.request("POST", f"/api/sandboxes/{saved}/checkpoints", {"name": "before the crash"}).json()["id"]
    ex(g, saved, "x = 99")  # not in any checkpoint: lost with the runtime
    unsaved = g.create()["id"]
    kill9(g)
    # The host lost the runtimes too (a reboot, an OOM killer): nothing to adopt.
    root = str(g.home / "runtime" / "gvisor")
    for rt in runtimes(g, "gvisor"):
        subprocess.run(["runsc", "--root", root, "kill", rt, "KILL"], check=False)
    wait_for(lambda: not any(subprocess.run(["runsc", "--root", root, "state", rt], capture_output=True,
                                            text=True).stdout.count('"running"') for rt in runtimes(g, "gvisor")))
    g2 = again(g, home, tmp_path)
    try:
        back = g2.request("GET", f"/api/sandboxes/{saved}").json()
        assert back["state"] == "paused" and back["resume_from"] == cp, back
        assert cp in back["reason"] and "lost" in back["reason"]
        assert "not adopted" in g2.log_text()
        assert ex(g2, saved, "print(x, open('kept.txt').read())").stdout == "41 files too\n"
        lost = g2.request("GET", f"/api/sandboxes/{unsaved}").json()
        assert lost["state"] == "dead" and "no checkpoint" in lost["reason"], lost
        r = g2.request("POST", f"/api/sandboxes/{unsaved}/execute", {"code": "1"})
        assert r.status == 409 and r.json()["state"] == "dead" and "dead" in r.json()["message"], r.body
        # A restart gives the dead one a new runtime over its files.
        assert g2.request("POST", f"/api/kernels/{unsaved}/restart", {}).status == 200
        assert ex(g2, unsaved, "print(1 + 1)").stdout == "2\n"
    finally:
        g2.stop()


def test_cells_sent_while_a_checkpoint_runs_are_all_answered_in_order(home, tmp_path):
    g = Gateway(home, tmp_path)
    try:
        kid = g.start_kernel()
        c = g.connect(kid)
        assert c.execute("n = 0")["reply"]["status"] == "ok"
        result = {}

        def checkpoint():
            result["r"] = g.request("POST", f"/api/sandboxes/{kid}/checkpoints", {})

        t = threading.Thread(target=checkpoint)
        t.start()
        wait_for(lambda: g.request("GET", f"/api/sandboxes/{kid}").json()["state"] == "checkpointing", 30, 0.02)
        ids = []
        for _ in range(8):  # the client: one every 250 ms while the checkpoint runs
            ids.append(c.send("execute_request", {"code": "n += 1\nn", "silent": False, "store_history": True,
                                                  "user_expressions": {}, "allow_stdin": False}))
            time.sleep(0.25)
        t.join(120)
        assert result["r"].status == 201, result["r"].body
        replies, results = [], {}
        deadline = time.monotonic() + 120
        while len(replies) < 8 and time.monotonic() < deadline:
            m = c.recv(60)
            mid = m["parent_header"].get("msg_id")
            if m["msg_type"] == "execute_reply" and mid in ids:
                replies.append(mid)
                assert m["content"]["status"] == "ok", m["content"]
            elif m["msg_type"] == "execute_result" and mid in ids:
                results[mid] = m["content"]["data"]["text/plain"]
        assert replies == ids  # every one answered, in the order sent
        assert [results[i] for i in ids] == [str(k) for k in range(1, 9)]
        assert c.execute("n")["results"][0]["text/plain"] == "8"
        c.close()
    finally:
        g.stop()


def test_requests_above_a_ceiling_get_400_and_forks_inherit_limits(home, tmp_path):
    g = Gateway(home, tmp_path, env={"SANDGATE_MAX_MEMORY_MB": "2048", "SANDGATE_MAX_TTL": "3600"})
    try:
        r = g.request("POST", "/api/sandboxes", {"limits": {"memory_mb": 1000000, "cpus": 256}})
        assert r.status == 400 and "ceiling of 2048" in r.json()["message"] and "SANDGATE_MAX_MEMORY_MB" in r.json()["message"]
        assert r.json()["code"] == "above_ceiling"
        r = g.request("POST", "/api/sandboxes", {"limits": {"pids": 1000000}})
        assert r.status == 400 and "SANDGATE_MAX_PIDS" in r.json()["message"]
        r = g.request("POST", "/api/sandboxes", {"ttl": 7200})
        assert r.status == 400 and "SANDGATE_MAX_TTL" in r.json()["message"]
        r = g.request("POST", "/api/sandboxes", {"limits": {"memory_mb": 512}, "ttl": 600})
        assert r.status == 201, r.body
        sb = r.json()
        assert sb["limits"]["memory_mb"] == 512 and sb["limits"]["cpus"] == 1.0 and sb["expires"]
        fork = g.request("POST", f"/api/sandboxes/{sb['id']}/fork", {}).json()
        assert fork["limits"] == sb["limits"]  # a fork inherits its parent's limits
    finally:
        g.stop()


def test_an_unpausable_sandbox_at_sigterm_is_reported_not_silently_dropped(home, tmp_path):
    """A sandbox whose runtime died before the stop is kept as dead, with why."""
    g = Gateway(home, tmp_path, env=KEEP)
    sid = g.create()["id"]
    runtime = g.request("GET", f"/api/sandboxes/{sid}").json()["runtime_id"]
    subprocess.run(["runsc", "--root", str(g.home / "runtime" / "gvisor"), "kill", runtime, "KILL"], check=False)
    wait_for(lambda: g.request("GET", f"/api/sandboxes/{sid}").json()["state"] == "dead", 60)
    g.stop()
    g2 = again(g, home, tmp_path)
    try:
        info = g2.request("GET", f"/api/sandboxes/{sid}").json()
        assert info["state"] == "dead" and info["reason"], info
    finally:
        g2.stop()


def test_a_long_cell_runs_through_a_checkpoint_and_its_reply_arrives(home, tmp_path):
    """The restored agent checks its kernel on the control channel: on shell it
    would wait behind this cell, give up after 5 s and lose the cell's reply.
    The cell ticks until the test lets it finish, so it is still running however
    long the checkpoint takes, and goes on for more than those 5 s after it."""
    g = Gateway(home, tmp_path)
    try:
        kid = g.start_kernel()
        c = g.connect(kid)
        mid = c.send("execute_request", {"code": (
            "import os, time\nwhile not os.path.exists('go'):\n    print('tick')\n    time.sleep(1)\nprint('finished')"),
            "silent": False, "store_history": True, "user_expressions": {}, "allow_stdin": False})
        wait_for(lambda: g.request("GET", f"/api/kernels/{kid}").json()["execution_state"] == "busy", 30, 0.1)
        r = g.request("POST", f"/api/sandboxes/{kid}/checkpoints", {})
        assert r.status == 201, r.body
        assert g.request("GET", f"/api/kernels/{kid}").json()["execution_state"] == "busy"
        out, reply, ticks_after = "", None, None
        while reply is None:
            m = c.recv(120)
            if m["parent_header"].get("msg_id") != mid:
                continue
            if m["msg_type"] == "stream":
                out += m["content"]["text"]
                if ticks_after is None:
                    ticks_after = out.count("tick")  # what had come out by the checkpoint's end, at most
                elif out.count("tick") - ticks_after == 7:  # past the 5 s a shell probe would wait
                    r = g.request("PUT", f"/api/sandboxes/{kid}/files/go", raw=b"")
                    assert r.status == 201, r.body
            elif m["msg_type"] == "execute_reply":
                reply = m["content"]
        assert reply["status"] == "ok", reply
        assert out.endswith("tick\nfinished\n") and set(out.split()) == {"tick", "finished"}, out
        assert c.execute("1 + 1")["results"][0]["text/plain"] == "2"
        c.close()
    finally:
        g.stop()
