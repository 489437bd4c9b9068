"""The fleet: several gateway nodes sharing one session store (store/redis.py).

Each node writes a heartbeat with a TTL (its URL, free capacity), signed with
the fleet key (core/fleetauth.py); a request for a sandbox held by another
live node, one whose heartbeat verifies, is forwarded there (api/forward.py).
A node whose heartbeat expired is not answering: its sandboxes are reported
unavailable, naming the node. Restoring them elsewhere from shared checkpoint
storage is not done yet (docs/operations.md says what is).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Dict, NamedTuple, Optional

from .errors import Conflict, Unavailable
from .fleetauth import FleetAuth
from .tenants import Principal

if TYPE_CHECKING:
    from .manager import SandboxManager

log = logging.getLogger("sandgate.fleet")
HEARTBEAT_INTERVAL = 2.0
HEARTBEAT_TTL = 10.0  # five missed beats: the node is taken for gone


class Peer(NamedTuple):
    """Another live node: its id (what a forwarded request is signed for) and its URL."""

    node: str
    url: str


class Fleet:
    def __init__(self, manager: "SandboxManager", url: str, auth: FleetAuth):
        self.manager, self.url, self.auth = manager, url, auth
        self.store = manager.store
        self._refused: Dict[str, str] = {}  # node -> URL of a heartbeat that did not verify (logged once)
        self.unverified: set = set()  # nodes whose heartbeat did not verify, at the last look
        self.failures = 0
        self._task: Optional[asyncio.Task] = None
        self._stop = asyncio.Event()

    draining = False  # set by a drain: no new sandboxes come here

    def info(self) -> dict:
        free = 0 if self.draining else self.manager.settings.max_kernels - len(self.manager.sandboxes)
        return {"url": self.url, "capacity": max(0, free), "sandboxes": len(self.manager.sandboxes)}

    async def beat(self) -> None:
        await self.store.heartbeat(self.store.node, HEARTBEAT_TTL, self.auth.sign_heartbeat(self.info()))

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._loop())

    async def stop(self) -> None:
        self._stop.set()
        if self._task:
            await self._task

    async def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                await self.beat()
                if self.failures:
                    log.info("heartbeat written again after %d failures", self.failures)
                    self.failures = 0
            except Exception as e:  # the store restarting: keep beating, it reconnects
                self.failures += 1
                log.warning("heartbeat failed (%d in a row): %s", self.failures, e)
            try:
                await asyncio.wait_for(self._stop.wait(), HEARTBEAT_INTERVAL)
            except asyncio.TimeoutError:
                pass

    async def live(self) -> Dict[str, dict]:
        """The live nodes whose heartbeat is signed with the fleet key; others are not nodes (a URL
        written into Redis by someone without the key, or a node with another key), logged once."""
        out, self.unverified = {}, set()
        for node, info in (await self.store.live_nodes()).items():
            if node == self.store.node or self.auth.heartbeat_ok(node, info):
                out[node] = info
                self._refused.pop(node, None)
                continue
            self.unverified.add(node)
            if self._refused.get(node) != info.get("url"):
                self._refused[node] = info.get("url")
                log.warning("node %s: its heartbeat (url %r) is not signed with this fleet key: not trusted, "
                            "nothing is forwarded to it", node, info.get("url"))
        return out

    async def nodes(self) -> Dict[str, dict]:
        return {n: {k: v for k, v in i.items() if k != "sig"} for n, i in (await self.live()).items()}

    async def drain(self):
        """Hand every sandbox of this node off (Manager.hand_off), one at a time,
        yielding progress; then this node's heartbeat goes, so nothing is sent
        here any more. Needs the shared checkpoint store."""
        if not self.manager.checkpoints.shared:
            raise Conflict("a drain needs a checkpoint store shared by the fleet (SANDGATE_CHECKPOINT_STORE): "
                           "other nodes could not restore this node's checkpoints")
        self.draining = True
        await self.beat()  # capacity 0 at once: placement stops choosing this node
        todo = list(self.manager.sandboxes.values())
        for n, sb in enumerate(todo, 1):
            try:
                cid = await self.manager.hand_off(sb)
                yield {"sandbox": sb.id, "checkpoint": cid, "done": n, "total": len(todo)}
            except Exception as e:  # it stays here, and says why; the drain goes on
                log.warning("drain: sandbox %s not handed off: %s", sb.id, e)
                yield {"sandbox": sb.id, "error": str(e), "done": n, "total": len(todo)}
        self._stop.set()
        if self._task:
            await self._task
        await self.store.retire(self.store.node)

    async def others(self) -> Dict[str, str]:
        """node -> URL of every other live node."""
        return {n: i["url"] for n, i in (await self.live()).items()
                if n != self.store.node and i.get("url")}

    async def place(self) -> Optional[Peer]:
        """Where a new sandbox goes: the live node with the most free capacity,
        if that is not this one (ties stay here); None: here."""
        mine = self.info()["capacity"]
        best = max(((i.get("capacity", 0), n, i.get("url")) for n, i in (await self.live()).items()
                    if n != self.store.node and i.get("url")), default=None)
        return Peer(best[1], best[2]) if best and best[0] > mine else None

    async def locate(self, sandbox_id: str, who: Principal) -> Optional[Peer]:
        """The live node that holds ``sandbox_id``, if that is not this one;
        None when it is here or nowhere (the caller answers 404)."""
        if sandbox_id in self.manager.sandboxes:
            return None
        rec = await self.store.get(sandbox_id)
        if rec is None or rec.node == self.store.node or not who.sees(rec.owner):
            return None
        info = (await self.live()).get(rec.node)
        if info and info.get("url"):
            return Peer(rec.node, info["url"])
        if rec.node in self.unverified:  # a heartbeat is there, unsigned: maybe the node lives; take nothing over
            raise Unavailable(f"sandbox {sandbox_id} is on node {rec.node}, whose heartbeat in the store is not signed "
                              "with this fleet's key: nothing is sent to it")
        if self.draining:
            raise Unavailable(f"node {self.store.node} is draining: ask another node for sandbox {sandbox_id}")
        gone = (f"its node {rec.node} stopped answering (no heartbeat for {HEARTBEAT_TTL:g} s)" if rec.node
                else "it was moved off its node by a drain")
        if not self.manager.checkpoints.shared:
            raise Unavailable(f"sandbox {sandbox_id} is on node {rec.node}, which is not answering "
                              f"(no heartbeat for {HEARTBEAT_TTL:g} s); without a shared checkpoint store "
                              "(SANDGATE_CHECKPOINT_STORE) no other node can restore it")
        await self.manager.take_over(rec, gone)
        return None  # this node's now
