"""The real tornado app (gateway/app.py) over the fake driver, served on a loopback port by an
event loop in a thread of the test's own process: real HTTP and websocket clients, the real
service, manager, lifecycle and SQLite store; only the sandbox is fake (tests/fake_driver.py).
It answers like the `Gateway` of tests/conftest.py (request, connect, create, run_code, metrics,
log_text, stop), so a test of protocol or bookkeeping runs against either."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import uuid
from pathlib import Path
from typing import Optional

from conftest import Gateway, environment
from fake_driver import FakeDriver
from sandgate.app import make_app
from sandgate.config import Settings
from sandgate.connections import BoundedHTTPServer
from sandgate.core.manager import SandboxManager
from sandgate.core.service import SandboxService
from sandgate.kernelspecs import KernelSpecs
from sandgate.store.sqlite import SQLiteStore
from sandgate import metrics

# The fake is registered under the default driver's name, so kernelspecs and records read as a
# real gateway's do; what a sandbox does is the fake's (no isolation, no limits).
DRIVER = "gvisor"
LOGGERS = ("sandgate", "tornado")


class LogLines(logging.Handler):
    """What the gateway logged while it ran, for tests that read its log."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list = []
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


class InProcessGateway(Gateway):
    """One gateway on the fake driver; `env` takes the `SANDGATE_*` variables a real one would, as
    far as `Settings.load` reads them (the process environment is put back once they are read).
    Warm start is off unless `env` turns it on (a template is a real gateway's concern). What it
    logs is every `sandgate` and `tornado` line of the process while it runs."""

    def __init__(self, tmp: Path, token="test-token", env: Optional[dict] = None, own_home: Optional[Path] = None,
                 driver: Optional[FakeDriver] = None):
        self.token = token
        self.home = own_home or tmp / f"home-{uuid.uuid4().hex[:8]}"
        self.home.mkdir(parents=True, exist_ok=True)
        full = {"SANDGATE_WARM_START": "false", **(env or {}), "SANDGATE_HOME": str(self.home),
                "SANDGATE_TOKEN": token}
        full.setdefault("SANDGATE_KEEP_SANDBOXES", "false")
        with environment(full):
            self.settings = Settings.load()
        self.driver = driver or FakeDriver()
        self.driver.shares_workspace = False  # a plain directory: no loop-mounted disk for a fake
        self.log_lines = LogLines()
        self.log_levels = {name: logging.getLogger(name).level for name in LOGGERS}
        for name in LOGGERS:
            logging.getLogger(name).addHandler(self.log_lines)
            if logging.getLogger(name).getEffectiveLevel() > logging.INFO:
                logging.getLogger(name).setLevel(logging.INFO)  # what `serve` logs
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="in-process-gateway", daemon=True)
        self.thread.start()
        self.port = self.call(self._start())
        self.url = f"http://127.0.0.1:{self.port}"

    def call(self, coro, timeout: float = 60):
        """Run `coro` on the gateway's loop and wait for its result (its exception is raised here)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self) -> int:
        s = self.settings
        self.store = SQLiteStore(s.home / "sessions.db")
        self.manager = SandboxManager(s, {DRIVER: self.driver}, KernelSpecs([DRIVER], DRIVER), self.store)
        self.manager._rootfs = self.manager._agent_dir = s.home  # the fake needs no image
        metrics.watch(self.manager)
        self.service = SandboxService(self.manager)
        self.app = make_app(s, self.service)
        await self.store.reseal()
        await self.manager.recover()
        if s.warm_start:
            self.manager.pool.refill(DRIVER)
        self.server = BoundedHTTPServer(self.app, max_body_size=s.max_message_mb << 20,
                                        idle_connection_timeout=s.http_idle_timeout,
                                        body_timeout=s.http_body_timeout, max_connections=s.http_max_connections,
                                        max_connections_per_client=s.http_max_connections_per_client)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        sock.setblocking(False)
        self.server.add_socket(sock)
        return sock.getsockname()[1]

    async def _stop(self) -> None:
        self.app.settings["stopping"] = True
        self.server.stop()
        if self.settings.keep_sandboxes:
            await self.manager.suspend_all()
        else:
            await self.manager.delete_all()
        await self.store.close()

    def log_text(self) -> str:
        return "\n".join(self.log_lines.lines)

    def stop(self) -> None:
        if self.thread.is_alive():
            try:
                self.call(self._stop())
            finally:
                self.loop.call_soon_threadsafe(self.loop.stop)
                self.thread.join(30)
                self.loop.close()
                for name in LOGGERS:
                    logging.getLogger(name).removeHandler(self.log_lines)
                    logging.getLogger(name).setLevel(self.log_levels[name])
