"""A gateway on the Redis store, end to end: a real redis-server and a real
`sandgate serve` (runsc sandboxes). Its records and tenants live in Redis, not
in the home's SQLite file, and a restarted gateway reads them back from there."""

from __future__ import annotations

import subprocess

from conftest import Gateway, wait_for
from test_store import RedisServer


def test_a_gateway_keeps_its_sandboxes_and_tenants_in_redis(home, tmp_path):
    redis_dir = tmp_path / "redis"
    redis_dir.mkdir()
    server = RedisServer(redis_dir)
    env = {"SANDGATE_REDIS_URL": server.url, "SANDGATE_NODE_ID": "node-a", "SANDGATE_KEEP_SANDBOXES": "true"}
    g = Gateway(home, tmp_path, env=env)
    g2 = None
    try:
        sid = g.request("POST", "/api/sandboxes", {}).json()["id"]
        r = g.request("POST", f"/api/sandboxes/{sid}/execute", {"code": "x = 41"})
        assert r.status == 200 and r.json()["status"] == "ok", r.body
        token = g.request("POST", "/api/tenants", {"name": "acme"}).json()["token"]
        keys = subprocess.run(["redis-cli", "-s", str(server.sock), "--scan"], capture_output=True, text=True).stdout
        assert f"sandgate:sb:{sid}" in keys.split() and "sandgate:tenant:acme" in keys.split(), keys
        assert not (g.home / "sessions.db").exists()  # nothing in the embedded store
        g.stop()  # SIGTERM: paused to disk, the record says so in Redis
        state = subprocess.run(["redis-cli", "-s", str(server.sock), "hget", f"sandgate:sb:{sid}", "state"],
                               capture_output=True, text=True).stdout.strip()
        assert state == "paused"
        g2 = Gateway(home, tmp_path, own_home=g.home, env=env)
        listed = g2.request("GET", "/api/sandboxes").json()
        assert [s["id"] for s in listed] == [sid] and listed[0]["state"] == "paused"
        r = g2.request("POST", f"/api/sandboxes/{sid}/execute", {"code": "print(x + 1)"})
        assert r.json()["stdout"] == "42\n", r.body
        assert g2.request("GET", "/api/sandboxes", token=token).json() == []  # the tenant, from Redis
        assert g2.request("DELETE", f"/api/sandboxes/{sid}").status == 204
        assert f"sandgate:sb:{sid}" not in subprocess.run(["redis-cli", "-s", str(server.sock), "--scan"],
                                                          capture_output=True, text=True).stdout.split()
    finally:
        g.stop()
        if g2:
            g2.stop()
        server.stop()


def test_any_node_serves_a_sandbox_that_lives_on_another(home, tmp_path):
    """Two nodes on one Redis: a client of node A drives a sandbox on node B, REST and websocket
    (legacy and v1), streamed execute and files included; with B gone, A says which node is down."""
    redis_dir = tmp_path / "redis"
    redis_dir.mkdir()
    server = RedisServer(redis_dir)
    common = {"SANDGATE_REDIS_URL": server.url, "SANDGATE_WARM_START": "false"}
    a = Gateway(home, tmp_path, env={**common, "SANDGATE_NODE_ID": "node-a"})
    b = Gateway(home, tmp_path, env={**common, "SANDGATE_NODE_ID": "node-b"})
    try:
        sid = b.request("POST", "/api/sandboxes", {}).json()["id"]
        got = a.request("GET", f"/api/sandboxes/{sid}")
        assert got.status == 200 and got.json()["id"] == sid, got.body
        r = a.request("POST", f"/api/sandboxes/{sid}/execute", {"code": "x = 41\nprint(x + 1)"})
        assert r.status == 200 and r.json()["stdout"] == "42\n", r.body
        streamed = a.request("POST", f"/api/sandboxes/{sid}/execute?stream=1", {"code": "print('s')"})
        assert streamed.headers["Content-Type"].startswith("text/event-stream")
        assert b"event: output" in streamed.body and b"event: result" in streamed.body
        assert a.request("PUT", f"/api/sandboxes/{sid}/files/data.txt", raw=b"through node a").status == 201
        assert b.request("GET", f"/api/sandboxes/{sid}/files/data.txt").body == b"through node a"
        for v1 in (False, True):
            c = a.connect(sid, v1=v1)  # the Jupyter websocket, relayed to node B
            assert c.execute("x")["results"][0]["text/plain"] == "41"
            c.close()
        assert a.request("GET", f"/api/kernels/{sid}").json()["id"] == sid
        assert a.request("GET", f"/api/sandboxes/{sid}", token="wrong").status == 401  # auth first, then forwarding
        assert a.request("GET", "/api/sandboxes/00000000-0000-4000-8000-000000000000").status == 404
        forwarded = [line for line in a.request("GET", "/metrics").body.decode().splitlines()
                     if line.startswith("sandgate_forwarded_requests_total")]
        assert any('kind="websocket"' in line and not line.endswith(" 0.0") for line in forwarded), forwarded
        # Node B dies: its heartbeat expires, and A names the node instead of hanging or saying 404.
        b.proc.kill()
        b.proc.wait()
        at_once = a.request("GET", f"/api/sandboxes/{sid}")
        assert at_once.status == 503 and "unreachable" in at_once.json()["message"], at_once.body
        down = wait_for(lambda: (lambda r: r if "not answering" in r.json()["message"] else None)(
            a.request("GET", f"/api/sandboxes/{sid}")), timeout=30)
        assert down.status == 503 and "node node-b" in down.json()["message"], down.body
        # B comes back on its home: it adopts the sandbox, memory and all, and A serves it again.
        b = Gateway(home, tmp_path, own_home=b.home, env={**common, "SANDGATE_NODE_ID": "node-b"})
        r = wait_for(lambda: (lambda r: r if r.status == 200 else None)(
            a.request("POST", f"/api/sandboxes/{sid}/execute", {"code": "print(x)"})), timeout=30)
        assert r.json()["stdout"] == "41\n", r.body
        assert a.request("DELETE", f"/api/sandboxes/{sid}").status == 204
    finally:
        a.stop()
        b.stop()
        server.stop()


def test_new_sandboxes_go_where_there_is_room_and_lists_span_the_fleet(home, tmp_path):
    redis_dir = tmp_path / "redis"
    redis_dir.mkdir()
    server = RedisServer(redis_dir)
    common = {"SANDGATE_REDIS_URL": server.url, "SANDGATE_WARM_START": "false"}
    a = Gateway(home, tmp_path, env={**common, "SANDGATE_NODE_ID": "node-a", "SANDGATE_MAX_KERNELS": "2"})
    b = Gateway(home, tmp_path, env={**common, "SANDGATE_NODE_ID": "node-b", "SANDGATE_MAX_KERNELS": "8"})
    try:
        r = a.request("POST", "/api/sandboxes", {})  # asked of A, which has less room: made on B
        assert r.status == 201, r.body
        sid = r.json()["id"]
        assert [s["id"] for s in b.request("GET", "/api/sandboxes?").json()] == [sid]
        assert b.request("GET", f"/api/sandboxes/{sid}", headers={"X-Sandgate-Forwarded": "test"}).status == 200
        assert a.request("GET", f"/api/sandboxes/{sid}", headers={"X-Sandgate-Forwarded": "test"}).status == 404
        kid = a.request("POST", "/api/kernels", {"name": "python3"}).json()["id"]  # the Jupyter API too
        for g in (a, b):  # either node lists the whole fleet
            assert sorted(s["id"] for s in g.request("GET", "/api/sandboxes").json()) == sorted([sid, kid])
            assert sorted(k["id"] for k in g.request("GET", "/api/kernels").json()) == sorted([sid, kid])
        for i in (sid, kid):
            assert a.request("DELETE", f"/api/sandboxes/{i}").status == 204
        assert a.request("GET", "/api/sandboxes").json() == []
    finally:
        a.stop()
        b.stop()
        server.stop()
