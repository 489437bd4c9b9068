"""A gateway on the Redis store, end to end: a real redis-server and a real
`sandgate serve` (runsc sandboxes). Its records and tenants live in Redis, not
in the home's SQLite file, and a restarted gateway reads them back from there."""

from __future__ import annotations

import subprocess

from conftest import Gateway
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
