"""Trust between callers and at rest: MCP sessions must not restore each other's checkpoints, and
the session store's files and secret values at rest must be unreadable to others. Real
gateways with gVisor sandboxes, the real MCP client library, a real redis-server; the fleet's
node-to-node forwarding is in test_hostile_trust_fleet.py (it starts fleets: slow)."""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys
from datetime import timedelta

import pytest
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client

from conftest import Gateway, free_port, wait_for
from sandgate_client import Sandbox

SECRET = "sk-live-7f3a9c1e5b2d4f60a8c9e1d3b5f7a9c2"  # a value that must never be at rest in clear


@pytest.fixture(scope="module")
def trust_gw(home, tmp_path_factory):
    g = Gateway(home, tmp_path_factory.mktemp("trust"), env={"SANDGATE_MAX_KERNELS": "8"})
    yield g
    g.stop()


def text(result) -> str:
    return "\n".join(c.text for c in result.content if c.type == "text")


@pytest.fixture
def mcp_http(trust_gw, tmp_path):
    """``sandgate mcp --transport http`` with the gateway's admin token: one server shared by sessions."""
    port = free_port()
    log = open(tmp_path / "mcp-http.log", "w")
    env = {**os.environ, "SANDGATE_URL": trust_gw.url, "SANDGATE_TOKEN": trust_gw.token}
    proc = subprocess.Popen([sys.executable, "-m", "sandgate.cli", "mcp", "--transport", "http", "--port", str(port)],
                            env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def up():
        assert proc.poll() is None, (tmp_path / "mcp-http.log").read_text()
        import socket
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0
    wait_for(up, timeout=60)
    yield f"http://127.0.0.1:{port}/mcp"
    proc.terminate()
    proc.wait(30)
    log.close()


# -- MCP sessions and each other's checkpoints -------------------------------------------------
def test_an_mcp_session_restores_only_its_own_sandboxes_checkpoints(trust_gw, mcp_http):
    """Session A saves a checkpoint holding a variable and a file; session B, on the same MCP server
    (so the same gateway token, here the admin's), asks to restore it, and a tenant's checkpoint
    too: both refused as unknown ids, and B's sandbox sees nothing of A's. A itself still restores."""
    tenant = trust_gw.request("POST", "/api/tenants", {"name": "victim7"}).json()["token"]
    victim = Sandbox.create(trust_gw.url, tenant, timeout=300)
    try:
        victim.run_code("tenant_secret = 'tenant-only'")
        tenant_cp = victim.checkpoint("tenant's").id

        async def main():
            async with streamable_http_client(mcp_http) as (read, write, _):
                async with ClientSession(read, write, read_timeout_seconds=timedelta(seconds=180)) as a:
                    await a.initialize()
                    await a.call_tool("execute_code", {"code": "a_secret = 'A-only'"})
                    await a.call_tool("write_file", {"path": "a.txt", "content": "A's file"})
                    cp = (await a.call_tool("checkpoint", {"name": "a"})).structuredContent["checkpoint"]
                    async with streamable_http_client(mcp_http) as (read2, write2, _):
                        async with ClientSession(read2, write2, read_timeout_seconds=timedelta(seconds=180)) as b:
                            await b.initialize()
                            await b.call_tool("execute_code", {"code": "b_own = 1"})
                            for other in (cp, tenant_cp):
                                r = await b.call_tool("restore", {"checkpoint": other})
                                assert r.isError and f"No such checkpoint: {other}" in text(r), text(r)
                            r = await b.call_tool("execute_code", {"code": "b_own"})
                            assert not r.isError and r.structuredContent["result"] == "1"  # still B's own
                            for probe in ("a_secret", "tenant_secret"):
                                r = await b.call_tool("execute_code", {"code": probe})
                                assert r.isError and "NameError" in text(r), text(r)
                            r = await b.call_tool("read_file", {"path": "a.txt"})
                            assert r.isError and "NotFound" in text(r), text(r)
                            # Before any sandbox of its own, too.
                    async with streamable_http_client(mcp_http) as (read3, write3, _):
                        async with ClientSession(read3, write3, read_timeout_seconds=timedelta(seconds=180)) as c:
                            await c.initialize()
                            r = await c.call_tool("restore", {"checkpoint": cp})
                            assert r.isError and "No such checkpoint" in text(r), text(r)
                    # A's own checkpoint: restored, as before.
                    await a.call_tool("execute_code", {"code": "a_secret = 'changed'"})
                    r = await a.call_tool("restore", {"checkpoint": cp})
                    assert not r.isError, text(r)
                    r = await a.call_tool("execute_code", {"code": "a_secret"})
                    assert r.structuredContent["result"] == "'A-only'"

        asyncio.run(main())
        # Nothing was started from the tenant's checkpoint but by the tenant.
        started = [s for s in Sandbox.list(trust_gw.url, trust_gw.token) if s.raw.get("parent")
                   and s.raw["parent"].get("checkpoint") == tenant_cp]
        assert started == []
    finally:
        victim.delete()
        trust_gw.request("DELETE", "/api/tenants/victim7")


def test_the_gateway_keeps_tenants_to_their_own_checkpoints(trust_gw):
    """The gateway's side: a tenant cannot start, fork or E2B-create from another
    tenant's checkpoint, nor fork another's sandbox; each is the 404 an unknown id gets."""
    ta = trust_gw.request("POST", "/api/tenants", {"name": "ta7"}).json()["token"]
    tb = trust_gw.request("POST", "/api/tenants", {"name": "tb7"}).json()["token"]
    try:
        a = trust_gw.request("POST", "/api/sandboxes", {}, token=ta).json()["id"]
        b = trust_gw.request("POST", "/api/sandboxes", {}, token=tb).json()["id"]
        assert trust_gw.request("POST", f"/api/sandboxes/{a}/execute", {"code": "x = 'ta'"}, token=ta).status == 200
        cp = trust_gw.request("POST", f"/api/sandboxes/{a}/checkpoints", {}, token=ta).json()["id"]
        r = trust_gw.request("POST", "/api/sandboxes", {"checkpoint": cp}, token=tb)
        assert r.status == 404 and r.json()["message"] == f"No such checkpoint: {cp}", r.body
        r = trust_gw.request("POST", f"/api/sandboxes/{b}/fork", {"checkpoint": cp}, token=tb)
        assert r.status == 404 and r.json()["message"] == f"No such checkpoint: {cp}", r.body
        r = trust_gw.request("POST", f"/api/sandboxes/{a}/fork", {}, token=tb)
        assert r.status == 404, r.body
        r = trust_gw.request("POST", "/e2b/sandboxes", {"templateID": cp}, headers={"X-API-KEY": tb}, token="")
        assert r.status == 404, r.body
        assert trust_gw.request("GET", f"/api/sandboxes/{a}/checkpoints", token=tb).status == 404
        # Its owner still can.
        r = trust_gw.request("POST", "/api/sandboxes", {"checkpoint": cp}, token=ta)
        assert r.status == 201, r.body
        assert [s["owner"] for s in trust_gw.request("GET", "/api/sandboxes", token=tb).json()] == ["tb7"]
    finally:
        for name in ("ta7", "tb7"):
            trust_gw.request("DELETE", f"/api/tenants/{name}")


# -- a lone gateway: the session store's files, secret values at rest -----------------------------
SECRET_BODY = {"egress": {"allow": ["api.secret.test:443"]},
               "secrets": [{"host": "api.secret.test", "header": "Authorization", "value": f"Bearer {SECRET}"},
                           {"host": "api.secret.test", "name": "API_KEY", "value": SECRET}]}


def store_files(home) -> dict:
    return {p.name: p for p in home.iterdir() if p.name.startswith("sessions.db")}


def test_the_session_store_is_0600_and_holds_no_secret_value_in_clear(trust_gw):
    """sessions.db-wal and -shm hold every record, so they are 0600 like the database (SQLite gives
    them the database's mode), and secret values in records are sealed, never in clear."""
    r = trust_gw.request("POST", "/api/sandboxes", SECRET_BODY)
    assert r.status == 201, r.body
    sid = r.json()["id"]
    try:
        trust_gw.request("POST", f"/api/sandboxes/{sid}/pause", {"mode": "memory"})  # more writes to the WAL
        files = store_files(trust_gw.home)
        assert {"sessions.db", "sessions.db-wal", "sessions.db-shm"} <= files.keys(), files
        modes = {name: stat.S_IMODE(p.stat().st_mode) for name, p in files.items()}
        assert set(modes.values()) == {0o600}, modes
        key = trust_gw.home / "secrets.key"
        assert stat.S_IMODE(key.stat().st_mode) == 0o600 and len(key.read_bytes()) == 32
        for name, p in files.items():
            raw = p.read_bytes()
            assert SECRET.encode() not in raw, name
        # Still the proxy's: the value opens, the sandbox's model still names where it goes.
        assert [s["host"] for s in trust_gw.request("GET", f"/api/sandboxes/{sid}").json()["secrets"]] == \
            ["api.secret.test", "api.secret.test"]
    finally:
        trust_gw.request("DELETE", f"/api/sandboxes/{sid}")


def test_a_store_from_before_is_resealed_and_its_files_made_0600(tmp_path):
    """A home written by the code before: a 0644 database and WAL with a secret value in clear. The
    store opens it: files 0600, the record read, then rewritten sealed; no clear copy left in the
    database or its WAL (secure_delete, and the WAL checkpointed and truncated)."""
    import sqlite3

    from sandgate.core.record import SandboxRecord
    from sandgate.egress.policy import EgressPolicy
    from sandgate.egress.secrets import Secret
    from sandgate.store.sqlite import SCHEMA, SQLiteStore

    path = tmp_path / "sessions.db"
    old = os.umask(0o022)
    try:
        db = sqlite3.connect(str(path), isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        db.executescript(SCHEMA)
        rec = SandboxRecord(id="s1", kernel_name="python3", driver="gvisor", egress=EgressPolicy(allow=["a.test"]),
                            secrets=[Secret(host="a.test", header="Authorization", value=SECRET)])
        db.execute("INSERT INTO sandboxes (id, node, state, version, record) VALUES (?, ?, ?, ?, ?)",
                   (rec.id, rec.node, rec.state.value, 1, rec.model_dump_json()))  # what the old store wrote
        assert SECRET.encode() in (path.read_bytes() + (tmp_path / "sessions.db-wal").read_bytes())
        assert stat.S_IMODE((tmp_path / "sessions.db-wal").stat().st_mode) == 0o644  # as a store made without the 0600 step leaves it
        db.close()  # (the WAL stays: another connection of the old gateway would hold it)
        if not (tmp_path / "sessions.db-wal").exists():
            (tmp_path / "sessions.db-wal").touch(0o644)

        store = SQLiteStore(path)
        modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()}
        assert all(m == 0o600 for n, m in modes.items() if n.startswith("sessions.db") or n == "secrets.key"), modes
        got = asyncio.run(store.get("s1"))
        assert got.secrets[0].value.get_secret_value() == SECRET  # the old record still reads
        assert asyncio.run(store.reseal()) == 1
        assert asyncio.run(store.reseal()) == 0  # once
        got = asyncio.run(store.get("s1"))
        assert got.secrets[0].value.get_secret_value() == SECRET
        raw = b"".join(p.read_bytes() for p in tmp_path.iterdir() if p.name.startswith("sessions.db"))
        assert SECRET.encode() not in raw
        asyncio.run(store.close())
    finally:
        os.umask(old)


def redis_cli(server, *args) -> str:
    return subprocess.run(["redis-cli", "-s", str(server.sock), *args], capture_output=True, text=True,
                          check=True).stdout.strip()


def test_redis_records_hold_secret_values_sealed_and_bound_to_their_record(tmp_path):
    """Secrets at rest in Redis (a real redis-server): a value is sealed with the fleet
    key; a record from before (in clear) still reads and is rewritten sealed; a sealed value moved
    to another host or record does not open; a node with another fleet key refuses the store."""
    from test_store import RedisServer

    from sandgate.core.record import SandboxRecord
    from sandgate.egress.policy import EgressPolicy
    from sandgate.egress.secrets import Secret
    from sandgate.store.redis import RedisStore
    from sandgate.store.seal import SealError, Sealer

    server = RedisServer(tmp_path)
    key = "fleet-key-for-this-test-0123456789abcdef"

    def rec(i):
        return SandboxRecord(id=i, kernel_name="python3", driver="gvisor", egress=EgressPolicy(allow=["a.test"]),
                             secrets=[Secret(host="a.test", header="Authorization", value=SECRET)])

    async def main():
        store = RedisStore(server.url, node="n1", prefix="t:", sealer=Sealer.from_fleet_key(key))
        assert await store.reseal() == 0  # the key's check value is set
        await store.put(rec("s1"))
        raw = redis_cli(server, "hget", "t:sb:s1", "record")
        assert SECRET not in raw and "sgenc1:" in raw
        assert (await store.get("s1")).secrets[0].value.get_secret_value() == SECRET
        # A record the code before wrote: the value in clear.
        await store.redis.hset("t:sb:s2", mapping={"record": rec("s2").model_dump_json(), "state": "starting",
                                                    "node": "n1", "version": 1})
        await store.redis.sadd("t:sandboxes", "s2")
        assert (await store.get("s2")).secrets[0].value.get_secret_value() == SECRET
        assert await store.reseal() == 1
        assert SECRET not in redis_cli(server, "hget", "t:sb:s2", "record")
        assert (await store.get("s2")).secrets[0].value.get_secret_value() == SECRET
        # A Redis writer points s1's secret at another host, or copies its sealed value into s2: no value.
        for target, edit in (("s1", lambda r: r.replace('"a.test"', '"evil.test"')),
                             ("s2", lambda r: redis_cli(server, "hget", "t:sb:s1", "record").replace('"s1"', '"s2"'))):
            raw = redis_cli(server, "hget", f"t:sb:{target}", "record")
            await store.redis.hset(f"t:sb:{target}", "record", edit(raw))
            with pytest.raises(SealError):
                await store.get(target)
        await store.close()
        other = RedisStore(server.url, node="n2", prefix="t:", sealer=Sealer.from_fleet_key(key + "-other"))
        with pytest.raises(SealError, match="SANDGATE_FLEET_KEY differs"):
            await other.reseal()
        await other.close()
        bare = RedisStore(server.url, node="n3", prefix="t:")  # no key at all: nothing in clear, ever
        with pytest.raises(SealError):
            await bare.put(rec("s3"))
        await bare.close()

    try:
        asyncio.run(main())
    finally:
        server.stop()


def test_fleet_signatures_hold_only_for_their_node_time_key_and_once():
    """The fleet key's checks (core/fleetauth.py) one by one, with a clock the test moves: what the
    fleet tests cannot reach through HTTP (a skewed clock, a heartbeat edited or too old)."""
    from tornado.httputil import HTTPHeaders

    from sandgate.core.fleetauth import FleetAuth, FleetAuthError
    from sandgate.core.tenants import ADMIN, Principal

    now = [1_000_000.0]
    key = "k" * 40
    a, b = FleetAuth(key, "node-a", clock=lambda: now[0]), FleetAuth(key, "node-b", clock=lambda: now[0])
    stranger = FleetAuth("x" * 40, "node-a", clock=lambda: now[0])

    def headers(auth, to="node-b", who=Principal("acme"), body=b"{}"):
        return HTTPHeaders(auth.sign("POST", "/api/sandboxes/s/execute", body, to, who))

    h = headers(a)
    assert b.verify("POST", "/api/sandboxes/s/execute", b"{}", h) == (Principal("acme"), "node-a")
    with pytest.raises(FleetAuthError, match="replayed"):
        b.verify("POST", "/api/sandboxes/s/execute", b"{}", h)
    for method, uri, body, hdrs, why in [
            ("POST", "/api/sandboxes/s/execute", b"{}", headers(a, to="node-c"), "signed for node"),
            ("POST", "/api/sandboxes/s/execute", b"{}", headers(stranger), "bad signature"),
            ("POST", "/api/sandboxes/s/execute", b'{"code": "1"}', headers(a), "bad signature"),
            ("POST", "/api/sandboxes/t/execute", b"{}", headers(a), "bad signature"),
            ("GET", "/api/sandboxes/s/execute", b"{}", headers(a), "bad signature")]:
        with pytest.raises(FleetAuthError, match=why):
            b.verify(method, uri, body, hdrs)
    forged = headers(a)
    forged["X-Sandgate-Principal"] = "admin"
    with pytest.raises(FleetAuthError, match="bad signature"):
        b.verify("POST", "/api/sandboxes/s/execute", b"{}", forged)
    old = headers(a, who=ADMIN)
    now[0] += 61
    with pytest.raises(FleetAuthError, match="signed 61 s ago"):
        b.verify("POST", "/api/sandboxes/s/execute", b"{}", old)

    beat = a.sign_heartbeat({"url": "http://127.0.0.1:1", "capacity": 3, "sandboxes": 1})
    assert b.heartbeat_ok("node-a", beat)
    assert not b.heartbeat_ok("node-b", beat)  # another node's name
    assert not b.heartbeat_ok("node-a", {**beat, "url": "http://127.0.0.1:2"})
    assert not b.heartbeat_ok("node-a", {**beat, "capacity": 99})
    assert not b.heartbeat_ok("node-a", {"url": "http://127.0.0.1:2", "capacity": 99})
    assert not stranger.heartbeat_ok("node-a", beat)
    now[0] += 61
    assert not b.heartbeat_ok("node-a", beat)  # replayed after its window
