"""Execution ids across a fleet, with real processes: a real redis-server, real
gateway nodes on loopback (runsc sandboxes), one shared checkpoint directory.

An execute that names an id runs at most once wherever it is sent; when the
node holding the sandbox dies mid-call (kill -9), the client gets 503
``unavailable`` naming the node, and a retry with the same id, once another
node has restored the sandbox from its checkpoint, runs the code exactly once
there. The SDK's run_code does that retry by itself."""

from __future__ import annotations

import json
import re
import threading

from conftest import Gateway, wait_for
from test_fleet import fleet_env, redis  # noqa: F401 (the fixture)

HERE = {"X-Sandgate-Forwarded": "test"}  # made on the node asked, whatever the capacities say
# Counts its runs in the kernel; sleeps while `slow` is set (after the checkpoint), so B dies mid-call.
COUNTED = "import time\nn = globals().get('n', 0) + 1\nif globals().get('slow'):\n    time.sleep(600)\nprint(n)"
# The same, printing a token of its own run first: two runs are told apart by what they print.
TOKENED = "import time, uuid\nprint('run', uuid.uuid4().hex, flush=True)\n" + COUNTED.split("\n", 1)[1]


def busy_on(node: Gateway, sid: str):
    """The owner's own view: its kernel is running a cell."""
    r = node.request("GET", f"/api/kernels/{sid}", headers=HERE)
    return r.status == 200 and r.json()["execution_state"] == "busy"


def taken_over(node: Gateway, sid: str, cp: str):
    r = node.request("GET", f"/api/sandboxes/{sid}")
    return r.status == 200 and r.json()["state"] == "paused" and r.json()["resume_from"] == cp and r.json()


def test_an_execute_id_runs_once_through_any_node(home, tmp_path, redis):  # noqa: F811
    common = fleet_env(redis)
    a, b, c = (Gateway(home, tmp_path, env={**common, "SANDGATE_NODE_ID": f"node-{n}"}) for n in "abc")
    try:
        sid = b.request("POST", "/api/sandboxes", {}, headers=HERE).json()["id"]
        first = a.request("POST", f"/api/sandboxes/{sid}/execute", {"code": COUNTED, "id": "count-1"})
        assert first.status == 200 and first.json()["stdout"] == "1\n", first.body
        for node in (a, c, a):  # the same id through A again and through C: the stored result
            again = node.request("POST", f"/api/sandboxes/{sid}/execute", {"code": COUNTED, "id": "count-1"})
            assert again.status == 200 and again.json() == first.json(), again.body
        streamed = c.request("POST", f"/api/sandboxes/{sid}/execute?stream=1", {"code": COUNTED, "id": "count-1"})
        assert b"event: result" in streamed.body and b'"text": "1\\n"' in streamed.body, streamed.body
        # The counter says it ran once; a new id runs again.
        assert a.request("POST", f"/api/sandboxes/{sid}/execute", {"code": "print(n)"}).json()["stdout"] == "1\n"
        r = c.request("POST", f"/api/sandboxes/{sid}/execute", {"code": COUNTED, "id": "count-2"})
        assert r.json()["stdout"] == "2\n", r.body
        # A kernel websocket through A (relayed to B) sending one execute_request twice: run once.
        ws = a.connect(sid)
        header = {"msg_id": "ws-dup-1", "msg_type": "execute_request", "session": ws.session, "username": "test",
                  "date": "2026-01-01T00:00:00.000000Z", "version": "5.3"}
        frame = json.dumps({"header": header, "parent_header": {}, "metadata": {}, "channel": "shell",
                            "content": {"code": COUNTED, "silent": False, "store_history": True,
                                        "user_expressions": {}, "allow_stdin": False}})
        ws.ws.send(frame)
        ws.ws.send(frame)
        assert ws.execute("print(n)")["stdout"] == "3\n"  # FIFO: a second run would have come first and made 4
        replies = [m for m in ws.seen if m["msg_type"] == "execute_reply" and m["parent_header"]["msg_id"] == "ws-dup-1"]
        assert len(replies) == 1, replies
        ws.close()
        bad = a.request("POST", f"/api/sandboxes/{sid}/execute", {"code": "1", "id": "no spaces"})
        assert bad.status == 400, bad.body  # refused by A before forwarding, or by B: a 400 either way
        assert a.request("DELETE", f"/api/sandboxes/{sid}").status == 204
    finally:
        for g in (a, b, c):
            g.stop()


def fleet_with_a_checkpointed_sandbox_on_b(home, tmp_path, redis, nodes="abc"):  # noqa: F811
    common = fleet_env(redis, SANDGATE_CHECKPOINT_STORE=str(tmp_path / "checkpoints"))
    gws = {n: Gateway(home, tmp_path, env={**common, "SANDGATE_NODE_ID": f"node-{n}"}) for n in nodes}
    a, b = gws["a"], gws["b"]
    sid = b.request("POST", "/api/sandboxes", {}, headers=HERE).json()["id"]
    assert a.request("POST", f"/api/sandboxes/{sid}/execute", {"code": "n = 0"}).json()["status"] == "ok"
    cp = a.request("POST", f"/api/sandboxes/{sid}/checkpoints", {}).json()["id"]
    assert a.request("POST", f"/api/sandboxes/{sid}/execute", {"code": "slow = True"}).json()["status"] == "ok"
    return gws, sid, cp, common


def reap(gws: dict, common: dict, home, tmp_path) -> None:
    """B's runtime outlived its kill -9; B started again on its home finds no record of its own and reaps it."""
    b = gws["b"]
    if b.proc.poll() is not None:
        b.log.close()
        gws["b"] = Gateway(home, tmp_path, own_home=b.home, env={**common, "SANDGATE_NODE_ID": "node-b"})
    for g in gws.values():
        g.stop()


def test_a_node_killed_mid_execute_gives_503_and_the_retry_runs_once_elsewhere(home, tmp_path, redis):  # noqa: F811
    gws, sid, cp, common = fleet_with_a_checkpointed_sandbox_on_b(home, tmp_path, redis)
    a, b, c = gws["a"], gws["b"], gws["c"]
    try:
        got = {}
        call = threading.Thread(target=lambda: got.update(r=a.request(
            "POST", f"/api/sandboxes/{sid}/execute", {"code": COUNTED, "id": "long-1", "timeout": 900})))
        call.start()
        wait_for(lambda: busy_on(b, sid), timeout=60)
        b.proc.kill()
        b.proc.wait()
        call.join(60)
        assert not call.is_alive()
        r = got["r"]
        assert r.status == 503, (r.status, r.body)
        body = r.json()  # whole JSON, not a truncated or HTML body
        assert body["code"] == "unavailable" and body["node"] == b.url, body
        assert "same id" in body["message"], body
        # Once B's heartbeat expires, A restores the sandbox from the checkpoint (n = 0, not slow).
        wait_for(lambda: taken_over(a, sid, cp), timeout=60)
        again = a.request("POST", f"/api/sandboxes/{sid}/execute", {"code": COUNTED, "id": "long-1"})
        assert again.status == 200 and again.json()["stdout"] == "1\n", again.body
        for node in (c, a):  # answered from A's record from now on, through any node
            r = node.request("POST", f"/api/sandboxes/{sid}/execute", {"code": COUNTED, "id": "long-1"})
            assert r.status == 200 and r.json() == again.json(), r.body
        assert c.request("POST", f"/api/sandboxes/{sid}/execute", {"code": "print(n)"}).json()["stdout"] == "1\n"
        assert a.request("GET", f"/api/sandboxes/{sid}", headers=HERE).status == 200  # A holds it now
        assert a.request("DELETE", f"/api/sandboxes/{sid}").status == 204
    finally:
        reap(gws, common, home, tmp_path)


def test_the_sdks_run_code_rides_out_the_death_of_the_node_holding_its_sandbox(home, tmp_path, redis):  # noqa: F811
    """The run going on B dies with B; the SDK's retry through A runs the cell again from the
    checkpoint, says so (``reran``), and its callbacks get the new run whole after what the lost
    run had printed: the returned Execution is the new run's alone."""
    from sandgate_client import Sandbox

    gws, sid, cp, common = fleet_with_a_checkpointed_sandbox_on_b(home, tmp_path, redis, nodes="ab")
    a, b = gws["a"], gws["b"]
    try:
        sb = Sandbox.connect(sid, url=a.url, token=a.token)
        got, streamed = {}, []

        def run():
            try:
                got["ex"] = sb.run_code(TOKENED, on_stdout=streamed.append, timeout=120)
            except Exception as e:  # the assertion below says what it was
                got["error"] = e

        call = threading.Thread(target=run)
        call.start()
        wait_for(lambda: streamed and busy_on(b, sid), timeout=60)  # the lost run has printed its token
        lost = "".join(streamed)
        b.proc.kill()
        b.proc.wait()
        call.join(150)
        assert not call.is_alive()
        assert "error" not in got, got
        ex = got["ex"]
        assert re.fullmatch(r"run [0-9a-f]{32}\n1\n", ex.stdout) and ex.error is None, ex
        assert re.fullmatch(r"run [0-9a-f]{32}\n", lost) and lost.split()[1] != ex.stdout.split()[1]
        assert ex.reran and "".join(streamed) == lost + ex.stdout, (streamed, ex)
        assert a.request("GET", f"/api/sandboxes/{sid}", headers=HERE).json()["state"] == "running"  # on A
        assert a.request("POST", f"/api/sandboxes/{sid}/execute", {"code": "print(n)"}).json()["stdout"] == "1\n"
        assert a.request("DELETE", f"/api/sandboxes/{sid}").status == 204
    finally:
        reap(gws, common, home, tmp_path)
