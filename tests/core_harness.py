"""A gateway core on the fake driver, in-process, for tests that run in
seconds: the real service, manager, lifecycle and SQLite store; only the
sandbox is fake (tests/fake_driver.py)."""

from __future__ import annotations

import asyncio
import functools
import json
import uuid
from pathlib import Path
from typing import Dict, List, Optional

from fake_driver import FakeDriver
from sandgate.config import Settings
from sandgate.core.manager import SandboxManager
from sandgate.core.service import SandboxService, StartRequest
from sandgate.kernelspecs import KernelSpecs
from sandgate.store.sqlite import SQLiteStore


def run(fn):
    """Run an async test function to completion, with a deadline (a hang is a failure)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        async def bounded():
            return await asyncio.wait_for(fn(*args, **kwargs), 30)

        return asyncio.run(bounded())

    return wrapper


def make(home: Path, driver: Optional[FakeDriver] = None, **settings) -> SandboxService:
    settings = {"warm_start": False, "max_kernels": 8, **settings}
    s = Settings(home=home, **settings)
    drv = driver or FakeDriver()
    drv.shares_workspace = False  # a plain directory: no loop-mounted disk for a fake
    store = SQLiteStore(home / "sessions.db")
    m = SandboxManager(s, {"fake": drv}, KernelSpecs(["fake"], "fake"), store)
    m._rootfs = m._agent_dir = home  # the fake needs no image
    return SandboxService(m)


def driver_of(service: SandboxService) -> FakeDriver:
    return service.manager.drivers["fake"]


async def start(service: SandboxService, **kw):
    return await service.start(StartRequest(**kw))


class Client:
    """What a websocket connection is to a sandbox: a listener with a session."""

    replay = True

    def __init__(self, sandbox):
        self.sandbox = sandbox
        self.session = uuid.uuid4().hex
        self.session_ids = {self.session}
        self.queue: asyncio.Queue = asyncio.Queue()
        sandbox.attach(self)

    def deliver(self, channel: str, parts: List[bytes]) -> None:
        self.queue.put_nowait((channel, [json.loads(p) for p in parts[:4]]))

    def execute(self, code: str) -> str:
        header = {"msg_id": uuid.uuid4().hex, "msg_type": "execute_request", "session": self.session,
                  "username": "test", "date": "2026-01-01T00:00:00.000000Z", "version": "5.3"}
        content = {"code": code, "silent": False, "store_history": True, "user_expressions": {},
                   "allow_stdin": False}
        self.sandbox.send("shell", [json.dumps(x).encode() for x in (header, {}, {}, content)], header)
        return header["msg_id"]

    async def replies(self, msg_ids: List[str]) -> Dict[str, dict]:
        """The execute_reply of each request, plus what came for it on iopub."""
        got: Dict[str, dict] = {}
        order: List[str] = []
        out: Dict[str, List[str]] = {m: [] for m in msg_ids}
        while len(got) < len(msg_ids):
            channel, (header, parent, _, content) = await self.queue.get()
            mid = parent.get("msg_id")
            if mid not in out:
                continue
            if channel == "shell" and header["msg_type"] == "execute_reply":
                got[mid] = content
                order.append(mid)
            elif header["msg_type"] == "execute_result":
                out[mid].append(content["data"]["text/plain"])
            elif header["msg_type"] == "stream":
                out[mid].append(content["text"])
        for mid in msg_ids:
            got[mid]["outputs"] = out[mid]
        got["order"] = order
        return got
