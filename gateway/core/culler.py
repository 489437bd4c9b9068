"""Background work on a clock: delete sandboxes past their ttl, pause idle
ones, cull idle unconnected ones, keep the warm pool full.

A failure in one pass, or with one sandbox, is logged and counted and the
loop goes on: a loop that dies on its first exception would quietly stop
enforcing every ttl on the node.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import TYPE_CHECKING, Optional

from .. import metrics
from .errors import NotFound
from .messages import utcnow
from .states import State

if TYPE_CHECKING:
    from .manager import SandboxManager
    from .sandbox import Sandbox

log = logging.getLogger("sandgate.culler")


class Culler:
    def __init__(self, manager: "SandboxManager"):
        self.manager = manager
        self.settings = manager.settings
        self.failures: collections.Counter = collections.Counter()  # by kind: ttl, pause, cull, pass
        self.passes = 0
        self._task: Optional[asyncio.Task] = None
        self._stop = asyncio.Event()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.ensure_future(self._loop())

    async def stop(self) -> None:
        """Ends the loop after the pass in flight: a pass is never cancelled,
        so no pause or delete is cut in half."""
        self._stop.set()
        if self._task:
            await self._task
            self._task = None

    async def _loop(self) -> None:
        while not self._stop.is_set():
            try:  # ttl needs a finer clock than the cull interval
                await asyncio.wait_for(self._stop.wait(), min(self.settings.cull_interval, 10))
                return
            except asyncio.TimeoutError:
                pass
            try:
                await self.run_once()
            except Exception:
                self.failures["pass"] += 1
                metrics.CULLER_FAILURES.labels("pass").inc()
                log.exception("culler pass failed; the next one runs as usual")

    async def run_once(self) -> None:
        self.passes += 1
        metrics.CULLER_PASSES.inc()
        now = utcnow()
        for sb in list(self.manager.sandboxes.values()):
            if self._stop.is_set():
                return
            if sb.lock.locked():
                continue  # starting, checkpointing, pausing...: its clock starts again after
            kind = "ttl"
            try:
                if sb.record.expires and time.time() > sb.record.expires:
                    log.info("deleting sandbox %s: its ttl has passed", sb.id)
                    await self.manager.delete(sb.id)
                    continue
                kind = "pause"
                if await self._maybe_pause(sb, (now - sb.last_activity).total_seconds()):
                    continue
                kind = "cull"
                await self._maybe_cull(sb, (now - sb.last_activity).total_seconds())
            except NotFound:
                pass  # deleted meanwhile
            except Exception as e:
                self.failures[kind] += 1
                metrics.CULLER_FAILURES.labels(kind).inc()
                log.warning("culler: %s of sandbox %s failed (%d so far): %s", kind, sb.id, self.failures[kind], e)
        for driver in self.manager.drivers:
            if self.manager.pool.ready.get(driver) is not None:
                self.manager.pool.refill(driver)

    async def _maybe_pause(self, sb: "Sandbox", idle: float) -> bool:
        after = self.settings.pause_idle_timeout
        # A sandbox paused in memory still holds it: idle long enough, it goes to disk too.
        idle_kernel = sb.state in (State.RUNNING, State.FROZEN) and sb.activity == "idle"
        if not (after and idle_kernel and idle > after):
            return False
        log.info("pausing sandbox %s: idle %.0f s", sb.id, idle)
        await sb.pause("disk")
        return True

    async def _maybe_cull(self, sb: "Sandbox", idle: float) -> None:
        timeout = self.settings.cull_idle_timeout
        if timeout and not len(sb.fanout) and sb.activity != "busy" and idle > timeout:
            log.info("culling sandbox %s: idle %.0f s with no connection", sb.id, idle)
            await self.manager.delete(sb.id)
