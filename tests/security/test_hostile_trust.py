"""Red-team findings of issue 29 about trust: MCP sessions restoring each other's checkpoints
(finding 7) and the session store's files and secret values at rest (findings 8 and 18). Real
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
    """``sandgate mcp --transport http`` with the gateway's admin token: what the red team ran."""
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


# -- finding 7: MCP sessions restore each other's checkpoints ------------------------------------
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
    """The gateway's side of finding 7: a tenant cannot start, fork or E2B-create from another
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
