"""`sandgate mcp` driven by the real MCP client library (mcp.ClientSession), over stdio
(a subprocess) and streamable HTTP, against a real gateway with runsc sandboxes."""

from __future__ import annotations

import asyncio
import base64
import os
import subprocess
import sys
from datetime import timedelta

import pytest
from mcp import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client

from conftest import Gateway, free_port, wait_for
from sandgate_client import Sandbox

NAMES = ["execute_code", "read_file", "write_file", "list_files", "checkpoint", "fork", "restore"]
PLOT = ("import matplotlib\nmatplotlib.use('Agg')\nimport matplotlib.pyplot as plt\n%matplotlib inline\n"
        "plt.plot([1, 4, 9]); plt.show()")


@pytest.fixture(scope="module")
def gw(home, tmp_path_factory):
    g = Gateway(home, tmp_path_factory.mktemp("gw"), env={"SANDGATE_MAX_KERNELS": "5"})
    yield g
    g.stop()


def mcp_sandboxes(gw) -> dict:
    """The gateway's sandboxes made by MCP sessions, by session label."""
    return {s.id: s.labels["mcp-session"] for s in Sandbox.list(gw.url, gw.token) if "mcp-session" in s.labels}


def text(result) -> str:
    return "\n".join(c.text for c in result.content if c.type == "text")


async def exercise(session: ClientSession) -> None:
    """What every transport must do."""
    await session.initialize()
    tools = (await session.list_tools()).tools
    assert [t.name for t in tools] == NAMES
    assert all(t.inputSchema["type"] == "object" and t.description for t in tools)

    r = await session.call_tool("execute_code", {"code": "1+1"})
    assert not r.isError and "2" in text(r) and r.structuredContent["result"] == "2"

    r = await session.call_tool("write_file", {"path": "notes/hello.txt", "content": "hello from mcp"})
    assert not r.isError
    r = await session.call_tool("read_file", {"path": "notes/hello.txt"})
    assert not r.isError and text(r) == "hello from mcp"
    r = await session.call_tool("list_files", {"path": "notes"})
    assert "hello.txt" in text(r)
    # The kernel sees the file the tool wrote.
    r = await session.call_tool("execute_code", {"code": "open('notes/hello.txt').read().upper()"})
    assert "HELLO FROM MCP" in text(r)

    # Bad arguments: tool errors, and the server still answers.
    for name, args in [("execute_code", {"cod": "1"}), ("execute_code", {"code": 5}), ("read_file", {}),
                       ("restore", {"checkpoint": "nope"}), ("no_such_tool", {}),
                       ("execute_code", {"code": "1", "timeout": "soon"})]:
        r = await session.call_tool(name, args)
        assert r.isError and text(r), (name, args)
    r = await session.call_tool("read_file", {"path": "missing.txt"})
    assert r.isError and "NotFound" in text(r)
    r = await session.call_tool("execute_code", {"code": "raise KeyError('k')"})
    assert r.isError and "KeyError" in text(r)
    r = await session.call_tool("execute_code", {"code": "6 * 7"})
    assert not r.isError and r.structuredContent["result"] == "42"

    # An image comes back as image content (matplotlib is in the sandbox image).
    r = await session.call_tool("execute_code", {"code": PLOT})
    images = [c for c in r.content if c.type == "image"]
    assert not r.isError and len(images) == 1 and images[0].mimeType == "image/png"
    assert base64.b64decode(images[0].data).startswith(b"\x89PNG")

    # checkpoint, then fork and restore continue in a new sandbox.
    await session.call_tool("execute_code", {"code": "v = 'saved'"})
    cp = (await session.call_tool("checkpoint", {"name": "mcp"})).structuredContent["checkpoint"]
    await session.call_tool("execute_code", {"code": "v = 'changed'"})
    r = await session.call_tool("restore", {"checkpoint": cp})
    assert not r.isError
    assert (await session.call_tool("execute_code", {"code": "v"})).structuredContent["result"] == "'saved'"


def test_stdio(gw, tmp_path):
    env = {"PYTHONPATH": os.environ.get("PYTHONPATH", ""), "SANDGATE_URL": gw.url, "SANDGATE_TOKEN": gw.token}
    params = StdioServerParameters(command=sys.executable, args=["-m", "sandgate.cli", "mcp"], env=env)
    before = set(mcp_sandboxes(gw))
    errlog = open(tmp_path / "mcp-stderr.log", "w")

    async def main():
        async with stdio_client(params, errlog=errlog) as (read, write):
            async with ClientSession(read, write, read_timeout_seconds=timedelta(seconds=180)) as session:
                await exercise(session)
                mine = set(mcp_sandboxes(gw)) - before
                assert len(mine) == 2  # the first sandbox and the restored one: one session's line
                return mine

    mine = asyncio.run(main())
    # The session ended: its sandboxes are deleted.
    wait_for(lambda: not (set(mcp_sandboxes(gw)) & mine), timeout=30)
    errlog.close()


def test_stdio_server_needs_a_reachable_gateway_only_when_a_tool_runs(tmp_path):
    port = free_port()  # nothing listens there
    env = {"PYTHONPATH": os.environ.get("PYTHONPATH", ""), "SANDGATE_URL": f"http://127.0.0.1:{port}",
           "SANDGATE_TOKEN": "t"}
    params = StdioServerParameters(command=sys.executable, args=["-m", "sandgate.cli", "mcp"], env=env)

    async def main():
        async with stdio_client(params, errlog=open(tmp_path / "err.log", "w")) as (read, write):
            async with ClientSession(read, write, read_timeout_seconds=timedelta(seconds=60)) as session:
                await session.initialize()
                assert len((await session.list_tools()).tools) == 7
                r = await session.call_tool("execute_code", {"code": "1"})
                assert r.isError and "Unavailable" in text(r)
                # Still answering.
                assert len((await session.list_tools()).tools) == 7

    asyncio.run(main())


@pytest.fixture
def http_server(gw, tmp_path):
    port = free_port()
    log = open(tmp_path / "mcp-http.log", "w")
    env = {**os.environ, "SANDGATE_URL": gw.url, "SANDGATE_TOKEN": gw.token}
    proc = subprocess.Popen([sys.executable, "-m", "sandgate.cli", "mcp", "--transport", "http", "--port", str(port)],
                            env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def up():
        assert proc.poll() is None, (tmp_path / "mcp-http.log").read_text()
        import socket
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0
    wait_for(up, timeout=60)
    yield f"http://127.0.0.1:{port}/mcp", proc
    if proc.poll() is None:
        proc.terminate()
        proc.wait(30)
    log.close()


def test_streamable_http_one_sandbox_per_session(gw, http_server):
    url, proc = http_server

    async def main():
        async with streamable_http_client(url) as (read, write, _):
            async with ClientSession(read, write, read_timeout_seconds=timedelta(seconds=180)) as a:
                await exercise(a)
                a_boxes = set(mcp_sandboxes(gw))
                async with streamable_http_client(url) as (read2, write2, _):
                    async with ClientSession(read2, write2, read_timeout_seconds=timedelta(seconds=180)) as b:
                        await b.initialize()
                        # B has a sandbox of its own: A's variables are not there.
                        r = await b.call_tool("execute_code", {"code": "v"})
                        assert r.isError and "NameError" in text(r)
                        await b.call_tool("execute_code", {"code": "w = 'b'"})
                        b_boxes = set(mcp_sandboxes(gw)) - a_boxes
                        assert len(b_boxes) == 1
                # B ended (the client's DELETE): its sandbox is gone, A's are still there.
                wait_for(lambda: not (set(mcp_sandboxes(gw)) & b_boxes), timeout=30)
                assert a_boxes <= set(mcp_sandboxes(gw))
                assert (await a.call_tool("execute_code", {"code": "v"})).structuredContent["result"] == "'saved'"
                return a_boxes

    a_boxes = asyncio.run(main())
    wait_for(lambda: not (set(mcp_sandboxes(gw)) & a_boxes), timeout=30)
    assert proc.poll() is None  # the server runs on
