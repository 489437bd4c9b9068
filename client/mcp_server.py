"""``sandgate mcp``: an MCP server (the ``mcp`` package's lowlevel ``Server``, mcp 1.x:
what pip resolves beside the gateway's own dependencies) exposing the tools of
``tools.py`` over stdio or streamable HTTP.

One sandbox per MCP session: the server's lifespan runs once per session (stdio: the
connection; HTTP: each ``mcp-session-id``), holds that session's ``ToolSession``, whose
sandbox is created on the first tool call, and deletes every sandbox of the session when
it ends (stdin closed, SIGTERM/SIGINT, the client's DELETE, the idle timeout, the server
stopping). It talks to a Sandgate gateway through the SDK (``--url``/``SANDGATE_URL``,
``--token``/``SANDGATE_TOKEN``). A failed tool call is a result with ``isError``, never a crash."""

from __future__ import annotations

import contextlib
import logging
import sys
import uuid
from typing import Optional

import anyio
import mcp.types as types
from mcp.server.lowlevel import Server

from .errors import SandgateError
from .sandbox import Sandbox
from .tools import TOOLS, ToolResult, ToolSession, description, input_schema, run_tool

log = logging.getLogger("sandgate.mcp")


def to_mcp(r: ToolResult) -> types.CallToolResult:
    content = [types.TextContent(type="text", text=c["text"]) if c["type"] == "text" else
               types.ImageContent(type="image", data=c["data"], mimeType=c["mime_type"]) for c in r.content]
    return types.CallToolResult(content=content, isError=r.is_error, structuredContent=r.data)


def make_server(url: Optional[str] = None, token: Optional[str] = None, create_args: Optional[dict] = None) -> Server:
    create_args = create_args or {}

    @contextlib.asynccontextmanager
    async def session_scope(_server):
        """Entered once per MCP session (Server.run): that session's sandboxes."""
        key = uuid.uuid4().hex[:12]
        args = {"labels": {"mcp-session": key}, **create_args}

        def create() -> Sandbox:
            sb = Sandbox.create(url, token, **args)
            log.info("session %s: sandbox %s", key, sb.id)
            return sb
        session = ToolSession(create=create, url=url, token=token, restore_args=args)
        try:
            yield {"tools": session, "key": key}
        finally:
            with anyio.CancelScope(shield=True):
                gone = await anyio.to_thread.run_sync(session.close)
            log.info("session %s ended: deleted %s", key, ", ".join(gone) or "nothing")

    server: Server = Server("sandgate", version=_version(), lifespan=session_scope,
                            instructions="Run Python in a sandboxed Jupyter kernel (Sandgate). State persists across "
                                         "execute_code calls; checkpoint, fork and restore branch it.")

    @server.list_tools()
    async def list_tools() -> list[types.Tool]:
        return [types.Tool(name=n, description=description(n), inputSchema=input_schema(n)) for n in TOOLS]

    # Arguments are validated by run_tool (pydantic), whose messages name the field at fault.
    @server.call_tool(validate_input=False)
    async def call_tool(name: str, arguments: dict) -> types.CallToolResult:
        try:
            session: ToolSession = server.request_context.lifespan_context["tools"]

            def run() -> ToolResult:
                with session.lock:  # one call at a time per session: they share a kernel
                    return run_tool(session, name, arguments)
            return to_mcp(await anyio.to_thread.run_sync(run))
        except Exception as e:  # never let a tool call take the server down
            log.exception("tool %s failed", name)
            return types.CallToolResult(content=[types.TextContent(type="text", text=f"{type(e).__name__}: {e}")],
                                        isError=True)

    return server


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:  # the distribution's, not the gateway package's: the SDK does not import the gateway
        return version("sandgate")
    except PackageNotFoundError:
        return "0"


async def run_stdio(url=None, token=None, create_args=None) -> None:
    """Serve one session on stdin/stdout, until stdin closes or SIGTERM/SIGINT (what MCP
    clients send after closing stdin); either way its sandboxes are deleted."""
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


def http_app(url=None, token=None, create_args=None, host="127.0.0.1", path="/mcp",
             session_idle_timeout: Optional[float] = 1800):
    """The Starlette app of the streamable HTTP transport (stateful: one session, one sandbox line)."""
    from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
    from mcp.server.transport_security import TransportSecuritySettings
    from starlette.applications import Starlette
    from starlette.routing import Route

    security = None
    if host in ("127.0.0.1", "localhost", "::1"):  # DNS rebinding protection, as the mcp package's own apps
        security = TransportSecuritySettings(enable_dns_rebinding_protection=True,
                                             allowed_hosts=["127.0.0.1:*", "localhost:*", "[::1]:*"],
                                             allowed_origins=["http://127.0.0.1:*", "http://localhost:*",
                                                              "http://[::1]:*"])
    manager = StreamableHTTPSessionManager(app=make_server(url, token, create_args), security_settings=security,
                                           session_idle_timeout=session_idle_timeout)

    class Endpoint:
        async def __call__(self, scope, receive, send):
            await manager.handle_request(scope, receive, send)

    return Starlette(routes=[Route(path, endpoint=Endpoint())], lifespan=lambda app: manager.run())


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
