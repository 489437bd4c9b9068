"""What a sandbox or a client can make the gateway itself hold, and its
bounds. Real gateway, real gVisor sandboxes."""

from __future__ import annotations

import socket

import psutil
import websocket

from conftest import Gateway, wait_for


def rss(gw: Gateway) -> int:
    return psutil.Process(gw.proc.pid).memory_info().rss


def test_requests_above_the_ceilings_are_refused_not_applied(home, tmp_path):
    g = Gateway(home, tmp_path)
    try:
        for limits, ceiling in (({"memory_mb": 1 << 20}, "SANDGATE_MAX_MEMORY_MB"), ({"cpus": 256}, "SANDGATE_MAX_CPUS"),
                                ({"pids": 1_000_000}, "SANDGATE_MAX_PIDS"), ({"disk_mb": 1 << 22}, "SANDGATE_MAX_DISK_MB")):
            r = g.request("POST", "/api/sandboxes", {"limits": limits})
            assert r.status == 400 and ceiling in r.json()["message"], (limits, r.body)
        assert g.request("GET", "/api/sandboxes").json() == []  # nothing was started for them
        # Within the ceilings, the limit is real: a 2 GB allocation in a 256 MB sandbox fails.
        sid = g.request("POST", "/api/sandboxes", {"limits": {"memory_mb": 256}}).json()["id"]
        r = g.request("POST", f"/api/sandboxes/{sid}/execute",
                      {"code": "b = bytearray(2 << 30)\nb[::4096] = b'1' * len(b[::4096])\nprint('allocated')"})
        assert "allocated" not in r.body.decode(errors="replace")
    finally:
        g.stop()


def test_the_token_never_reaches_the_access_log(home, tmp_path):
    g = Gateway(home, tmp_path)
    try:
        assert g.request("GET", f"/api/kernels?token={g.token}", token="").status == 200
        assert g.request("GET", "/api/kernels?token=wrong-guess", token="").status == 401
        kid = g.start_kernel()
        ws = websocket.create_connection(f"ws://127.0.0.1:{g.port}/api/kernels/{kid}/channels?session_id=s&token={g.token}")
        ws.close()
        wait_for(lambda: "/api/kernels?token=[redacted]" in g.log_text(), 10)
    finally:
        g.stop()
    log = g.log_text()
    assert g.token not in log and "wrong-guess" not in log
    assert log.count("token=[redacted]") >= 2


def test_one_execute_collects_at_most_its_cap(home, tmp_path):
    g = Gateway(home, tmp_path, env={"SANDGATE_EXECUTE_OUTPUT_MB": "8"})
    try:
        sid = g.request("POST", "/api/sandboxes", {}).json()["id"]
        before = rss(g)
        r = g.request("POST", f"/api/sandboxes/{sid}/execute", {"timeout": 600, "code": (
            "import sys\nchunk = 'x' * (1 << 20)\n"
            "for i in range(64): sys.stdout.write(chunk)\nsys.stdout.flush()\nprint('done')")})
        assert r.status == 200
        body = r.json()
        assert body["truncated"] is True and body["status"] == "ok"
        assert len(r.body) < 12 << 20  # was 64 MB and more (the issue measured 537 MB for 256)
        assert "output truncated" in body["stderr"] and "SANDGATE_EXECUTE_OUTPUT_MB" in body["stderr"]
        assert rss(g) - before < 150 << 20
        assert g.request("POST", f"/api/sandboxes/{sid}/execute", {"code": "print(1 + 1)"}).json()["stdout"] == "2\n"
    finally:
        g.stop()


def test_a_client_that_stops_reading_is_dropped_and_the_others_get_everything(home, tmp_path):
    g = Gateway(home, tmp_path, env={"SANDGATE_CLIENT_BUFFER_MB": "16", "SANDGATE_IOPUB_DATA_RATE": "0"})
    try:
        kid = g.start_kernel()
        reader = g.connect(kid)
        stalled = g.connect(kid)  # connected, never reads again
        stalled.ws.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        before = rss(g)
        mid = reader.send("execute_request", {"code": (
            "import sys\nchunk = 'y' * 999 + '\\n'\n"
            "for i in range(48 * 1024): sys.stdout.write(chunk)\nsys.stdout.flush()"),
            "silent": False, "store_history": False, "user_expressions": {}})
        got, idle = 0, False
        while not idle:
            m = reader.recv(300)
            if m["parent_header"].get("msg_id") != mid:
                continue
            if m["msg_type"] == "stream":
                got += len(m["content"]["text"])
            idle = m["msg_type"] == "status" and m["content"]["execution_state"] == "idle"
        assert got == 48 * 1024 * 1000  # every byte for the client that reads
        assert rss(g) - before < 150 << 20
        assert "stopped reading" in g.log_text()
        assert wait_for(lambda: g.request("GET", f"/api/kernels/{kid}").json()["connections"] == 1, 30)
        reader.close()
    finally:
        g.stop()


def test_iopub_is_rate_limited_per_client_with_a_notice(home, tmp_path):
    g = Gateway(home, tmp_path, env={"SANDGATE_IOPUB_MSG_RATE": "20"})
    try:
        kid = g.start_kernel()
        c = g.connect(kid)
        # One display_data message each (stream output would be batched by ipykernel).
        out = c.execute("from IPython.display import display\nfor i in range(400): display(i)", timeout=300)
        assert "IOPub message rate exceeded" in out["stderr"] and "SANDGATE_IOPUB_MSG_RATE" in out["stderr"]
        assert out["reply"]["status"] == "ok"  # the reply and idle always arrive
        assert len(out["displays"]) < 400
        # Once the window has passed, output flows again: the rate is over a sliding 3 s window.
        wait_for(lambda: c.execute("print('after')")["stdout"] == "after\n", timeout=60, interval=1)
        c.close()
    finally:
        g.stop()
