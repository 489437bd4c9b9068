"""Sandgate's Python SDK: sandboxes on a Sandgate gateway, sync and asyncio.

    from sandgate_client import Sandbox
    with Sandbox.create() as sb:           # SANDGATE_URL, SANDGATE_TOKEN
        print(sb.run_code("1+1").text)     # '2'

docs/sdk.md has the whole API."""

from .errors import (AuthError, BadRequest, Conflict, Forbidden, LimitReached, NotFound, QuotaExceeded, RateLimited,
                     SandboxDied, SandgateError, ServerError, Timeout, Unavailable)
from .models import Checkpoint, Execution, ExecutionError, FileEntry, Result, SandboxInfo
from .sandbox import Sandbox

__all__ = ["Sandbox", "AsyncSandbox", "KernelConnection", "Execution", "ExecutionError", "Result", "SandboxInfo",
           "Checkpoint", "FileEntry", "SandgateError", "BadRequest", "AuthError", "Forbidden", "LimitReached",
           "NotFound", "Conflict", "SandboxDied", "RateLimited", "QuotaExceeded", "Unavailable", "ServerError",
           "Timeout"]


def __getattr__(name):  # the websocket and asyncio parts load their dependencies only when used
    if name == "KernelConnection":
        from .kernel import KernelConnection
        return KernelConnection
    if name == "AsyncSandbox":
        from .aio import AsyncSandbox
        return AsyncSandbox
    raise AttributeError(name)
