"""``sandgate mcp``: an MCP server (the ``mcp`` package's lowlevel ``Server``) exposing the
tools of ``tools.py``, over stdio or streamable HTTP. Each MCP session gets its own
sandbox, created on its first tool call and deleted when the session ends (stdio: the
connection closes; HTTP: the client's DELETE, the idle timeout, or the server stopping).
It talks to a Sandgate gateway through the SDK (``--url``/``SANDGATE_URL``,
``--token``/``SANDGATE_TOKEN``). A failed tool call is a result with ``isError``, never a crash."""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import Any, Dict, Optional

import anyio
import mcp_types as types
from mcp.server.lowlevel import Server

from . import __name__ as _pkg  # noqa: F401  (the package must import cleanly first)
from .errors import SandgateError
from .sandbox import Sandbox
from .tools import TOOLS, ToolResult, ToolSession, description, input_schema, run_tool

log = logging.getLogger("sandgate.mcp")


class SandboxSessions:
    """One ToolSession (and so one sandbox line) per MCP session."""

    def __init__(self, url: Optional[str], token: Optional[str], create_args: Optional[dict] = None):
        self.url, self.token = url, token
        self.create_args = create_args or {}
        self.sessions: Dict[str, ToolSession] = {}

    def get(self, key: str) -> ToolSession:
        s = self.sessions.get(key)
        if s is None:
            args = {"labels": {"mcp-session": key[:60]}, **self.create_args}

            def create() -> Sandbox:
                sb = Sandbox.create(self.url, self.token, **args)
                log.info("session %s: sandbox %s", key, sb.id)
                return sb
            s = self.sessions[key] = ToolSession(create=create, url=self.url, token=self.token, restore_args=args)
        return s

    def close(self, key: str) -> None:
        s = self.sessions.pop(key, None)
        if s is not None:
            gone = s.close()
            log.info("session %s ended: deleted %s", key, ", ".join(gone) or "nothing")

    async def aclose(self, key: str) -> None:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self.close, key)

    async def aclose_all(self) -> None:
        for key in list(self.sessions):
            await self.aclose(key)


def session_key(ctx) -> str:
    req = getattr(ctx, "request", None)
    sid = None
    if req is not None:
        with contextlib.suppress(Exception):
            sid = req.headers.get("mcp-session-id")
    if sid:
        return sid
    # The connection (stdio: the only one) outlives the per-request ServerSession.
    conn = getattr(ctx.session, "_connection", None) or ctx.session
    return getattr(conn, "session_id", None) or f"conn-{id(conn)}"


def to_mcp(r: ToolResult) -> types.CallToolResult:
    content = [types.TextContent(type="text", text=c["text"]) if c["type"] == "text" else
               types.ImageContent(type="image", data=c["data"], mime_type=c["mime_type"]) for c in r.content]
    return types.CallToolResult(content=content, is_error=r.is_error, structured_content=r.data)


def make_server(url: Optional[str] = None, token: Optional[str] = None, create_args: Optional[dict] = None):
    sessions = SandboxSessions(url, token, create_args)

    @contextlib.asynccontextmanager
    async def lifespan(_server):
        try:
            yield {"sessions": sessions}
        finally:  # stdio: the connection ended; HTTP: the server stops
            await sessions.aclose_all()

    async def list_tools(ctx, params) -> types.ListToolsResult:
        return types.ListToolsResult(tools=[types.Tool(name=n, description=description(n), input_schema=input_schema(n))
                                            for n in TOOLS])

    async def call_tool(ctx, params: types.CallToolRequestParams) -> types.CallToolResult:
        try:
            session = sessions.get(session_key(ctx))

            def run() -> ToolResult:
                with session.lock:  # one call at a time per session: they share a kernel
                    return run_tool(session, params.name, params.arguments)
            return to_mcp(await anyio.to_thread.run_sync(run))
        except Exception as e:  # never let a tool call take the server down
            log.exception("tool %s failed", params.name)
            return types.CallToolResult(content=[types.TextContent(type="text", text=f"{type(e).__name__}: {e}")],
                                        is_error=True)

    server = Server("sandgate", version=_version(), lifespan=lifespan,
                    instructions="Run Python in a sandboxed Jupyter kernel (Sandgate). State persists across "
                                 "execute_code calls; checkpoint, fork and restore branch it.",
                    on_list_tools=list_tools, on_call_tool=call_tool)
    server.sandgate_sessions = sessions
    return server


def _version() -> str:
    try:
        from sandgate import __version__
        return __version__
    except Exception:
        return "0"


async def run_stdio(url=None, token=None, create_args=None) -> None:
    """Serve one connection on stdin/stdout. It ends when stdin closes, or at SIGTERM or
    SIGINT (what MCP clients send next): either way the session's sandboxes are deleted."""
    import signal

    from mcp.server.stdio import stdio_server
    server = make_server(url, token, create_args)

    async with anyio.create_task_group() as tg:
        async def stop_on_signal():
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for _ in signals:
                    tg.cancel_scope.cancel()
                    return

        async def serve():
            async with stdio_server() as (read, write):
                await server.run(read, write, server.create_initialization_options())
            tg.cancel_scope.cancel()
        tg.start_soon(stop_on_signal)
        tg.start_soon(serve)


def http_app(url=None, token=None, create_args=None, host="127.0.0.1", path="/mcp"):
    """The Starlette app of the streamable HTTP transport; a session's sandbox is deleted
    when the session manager discards the session."""
    server = make_server(url, token, create_args)
    app = server.streamable_http_app(streamable_http_path=path, host=host)
    manager = server.session_manager
    sessions = server.sandgate_sessions
    discard = manager._discard_session  # no public hook for a session's end in mcp 2.3

    async def discard_and_delete(session_id, transport):
        try:
            await discard(session_id, transport)
        finally:
            await sessions.aclose(session_id)
    manager._discard_session = discard_and_delete

    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(a):
        try:
            async with inner(a):
                yield
        finally:
            await sessions.aclose_all()
    app.router.lifespan_context = lifespan
    return app


def run_http(url=None, token=None, create_args=None, host="127.0.0.1", port=8765, path="/mcp") -> None:
    import uvicorn
    uvicorn.run(http_app(url, token, create_args, host, path), host=host, port=port, log_level="warning")


def main(args) -> int:
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    create_args = {k: v for k, v in (("driver", args.driver), ("ttl", args.ttl)) if v}
    try:
        if args.transport == "stdio":
            anyio.run(run_stdio, args.url, args.token, create_args)
        else:
            run_http(args.url, args.token, create_args, args.host, args.port, args.path)
    except KeyboardInterrupt:
        pass
    except SandgateError as e:
        print(f"sandgate mcp: {e}", file=sys.stderr)
        return 1
    return 0
