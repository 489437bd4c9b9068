"""Warm start: a template checkpoint per driver, and a pool of sandboxes
restored from it and ready to be handed out.

The template is the checkpoint of a freshly booted kernel, made once per
image and agent bundle (remembered in home/templates.json); a new sandbox
restores it instead of cold-starting Python. Pooled sandboxes have no record
in the store until one is taken and becomes a user's sandbox.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from typing import TYPE_CHECKING, Dict, List, Optional

from ..checkpoints import Checkpoint
from ..checkpoints.state_chunks import read_manifest
from .errors import Unavailable
from .record import SandboxRecord
from .sandbox import Sandbox
from .states import State

if TYPE_CHECKING:
    from .manager import SandboxManager

log = logging.getLogger("sandgate.pool")

# After a template could not be made (a full disk, say) or did not restore, warm start waits this
# long before the next try, doubling each time it fails again up to the last; sandboxes start cold
# meanwhile.
TEMPLATE_RETRY = (60.0, 3600.0)
_clock = time.monotonic  # of those waits (a test moves it on)


class WarmPool:
    def __init__(self, manager: "SandboxManager"):
        self.manager = manager
        self.settings = manager.settings
        self._file = self.settings.home / "templates.json"
        try:
            self.templates: Dict[str, str] = json.loads(self._file.read_text())
        except (OSError, ValueError):
            self.templates = {}
        self._lock = asyncio.Lock()
        self.ready: Dict[str, List[Sandbox]] = {}
        self._refilling: set = set()
        self._tasks: set = set()  # refills in flight, cancelled by close()
        self.failures = 0  # refills that failed, for operators
        self._current: set = set()  # template ids whose stored image format was checked
        self._outdated: set = set()  # template ids to be made anew (logged once)
        self._retry: Dict[str, tuple] = {}  # driver -> (monotonic time of the next template try, last wait)

    def _key(self, driver: str) -> str:
        from sandgate_images import rootfs as images

        return f"{driver}:{images.image_dir(self.settings.home).name}:{self.manager.agent_dir().name}"

    def enabled(self, driver: str) -> bool:
        return (self.settings.warm_start and self.manager.drivers[driver].can_checkpoint
                and _clock() >= self._retry.get(driver, (0.0, 0.0))[0])

    def ready_template(self, driver: str) -> Optional[Checkpoint]:
        if not self.enabled(driver):
            return None
        cid = self.templates.get(self._key(driver))
        try:
            cp = self.manager.checkpoints.get(cid) if cid else None
        except KeyError:
            return None
        return cp if cp is None or self._stored_as_now(cp.id) else None

    def _stored_as_now(self, cid: str) -> bool:
        """Whether template ``cid``'s image is stored as checkpoints are now. One from before gVisor
        chunks were zstd (codec deflate-sync) would be inflated by runsc at every restore: it is
        made anew instead (the old one is collected once no longer a template)."""
        if cid in self._current or cid in self._outdated:
            return cid in self._current
        try:
            files = read_manifest(self.manager.checkpoints.state_dir(cid))["files"]
        except ValueError:
            files = {}  # damaged: its restore says so
        if any(e.get("codec") == "deflate-sync" for e in files.values()):
            self._outdated.add(cid)  # first sight (the check above): logged once
            log.info("template checkpoint %s is stored in an older format (deflate-sync): a new one will be "
                     "made", cid)
            return False
        self._current.add(cid)
        return True

    def is_template(self, cid: str) -> bool:
        return cid in self.templates.values()

    def _scratch(self, prefix: str, driver: str) -> Sandbox:
        rec = SandboxRecord(id=f"{prefix}-{uuid.uuid4().hex[:8]}", kernel_name=prefix, driver=driver,
                            limits=self.settings.limits)
        sb = Sandbox(self.manager, rec)
        sb.persistent = False
        return sb

    async def template(self, driver: str) -> Optional[Checkpoint]:
        """The driver's template, made now if there is none yet."""
        if not self.settings.warm_start:
            return None
        key = self._key(driver)
        async with self._lock:
            cp = self.ready_template(driver)
            if cp:
                return cp
            t0 = time.monotonic()
            sb = self._scratch("template", driver)
            try:
                await sb.boot()
                await sb.to(State.RUNNING)
                cp = await sb.checkpoint("template", resume=False)
            except Exception as e:
                log.warning("warm start off for %s: could not make a template: %s; trying again in %.0f s",
                            driver, e, self._wait(driver))
                return None
            finally:
                await sb.teardown()
                await sb.ws.delete()
            self._retry.pop(driver, None)
            self.templates[key] = cp.id
            self._save()
            log.info("template checkpoint %s made for %s in %.1f s", cp.id, driver, time.monotonic() - t0)
            return cp

    def _wait(self, driver: str) -> float:
        """Warm start off for ``driver`` for a while (sandboxes start cold): 60 s after a first
        failure, twice as long after each next one, up to an hour. Returns the wait."""
        wait = min(max(TEMPLATE_RETRY[0], 2 * self._retry.get(driver, (0.0, 0.0))[1]), TEMPLATE_RETRY[1])
        self._retry[driver] = (_clock() + wait, wait)
        return wait

    def _save(self) -> None:
        tmp = self._file.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.templates))
        os.replace(tmp, self._file)

    def template_failed(self, driver: str, cid: str, why: Exception) -> None:
        """Template ``cid`` did not restore (a damaged image, a runsc that no longer reads it, or
        the host short of something): kept, it could fail every start. It is forgotten, collected
        with the other unused checkpoints, and a new one made after the wait (``_wait``)."""
        key = self._key(driver)
        if self.templates.get(key) != cid:
            return  # forgotten already: another start met it first (one wait, not two)
        del self.templates[key]
        self._save()
        log.warning("warm start off for %s: its template %s did not restore: %s; a new one is made in %.0f s",
                    driver, cid, why, self._wait(driver))

    def take(self, driver: str) -> Optional[Sandbox]:
        pool = self.ready.get(driver, [])
        while pool:
            sb = pool.pop(0)
            if sb.state == State.RUNNING and sb.activity == "idle" and sb.link and not sb.link.closed.done():
                return sb
            asyncio.ensure_future(self._discard(sb))
        return None

    def refill(self, driver: str) -> None:
        if not self.enabled(driver) or driver in self._refilling or self.manager.stopping:
            return
        self._refilling.add(driver)
        task = asyncio.ensure_future(self._refill(driver))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _refill(self, driver: str) -> None:
        try:
            pool = self.ready.setdefault(driver, [])
            cp = await self.template(driver)
            while cp and len(pool) < self.settings.pool_size:
                sb = self._scratch("pool", driver)
                try:
                    await sb.fill_workspace(cp)
                    await sb.boot_checkpoint(cp.id)
                except BaseException as e:  # failed, or the gateway is closing: nothing left behind
                    await asyncio.shield(self._discard(sb))
                    if isinstance(e, Unavailable):
                        self.template_failed(driver, cp.id, e)
                        return
                    raise
                await sb.to(State.RUNNING)
                pool.append(sb)
        except Exception as e:
            self.failures += 1
            log.warning("could not refill the warm pool for %s: %s", driver, e)
        finally:
            self._refilling.discard(driver)

    async def _discard(self, sb: Sandbox) -> None:
        await sb.teardown()
        await sb.ws.delete()

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for pool in self.ready.values():
            for sb in pool:
                await self._discard(sb)
        self.ready.clear()
