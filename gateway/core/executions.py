"""A sandbox's recent execution ids, so a retried execute runs at most once.

A caller (or the SDK, or a node forwarding for it) may name an execute with a
short id. A repeat of an id still running joins it: the joiner gets the outputs
so far, then live ones, then the same result. A repeat of a finished id gets
the stored result without running the code again. Both are bounded: the last
``max_ids`` ids, and finished results up to ``max_bytes`` in all (an evicted
result leaves the id remembered as run, answered with a 409, never run twice).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections import OrderedDict
from typing import Awaitable, Callable, Dict, List, Optional

from .errors import Conflict

ID_PATTERN = r"^[A-Za-z0-9._:-]{1,64}$"
_ID = re.compile(ID_PATTERN)
OutputCallback = Callable[[dict], Awaitable[None]]
# How a named execute is served: "new" (run now), "joined" (already running), "finished" (from the record).
BeginCallback = Callable[[str], Awaitable[None]]


class _Running:
    def __init__(self):
        self.outputs: List[dict] = []
        self.listeners: List[OutputCallback] = []
        self.done: asyncio.Future = asyncio.get_running_loop().create_future()

    async def output(self, out: dict) -> None:
        self.outputs.append(out)
        for cb in list(self.listeners):
            try:
                await cb(out)
            except Exception:  # one joiner's dropped connection is not the cell's problem
                self.listeners.remove(cb)


class Executions:
    def __init__(self, max_ids: int = 256, max_bytes: int = 8 << 20):
        self.max_ids, self.max_bytes = max_ids, max_bytes
        self.running: Dict[str, _Running] = {}
        self.finished: "OrderedDict[str, Optional[dict]]" = OrderedDict()  # None: result evicted
        self._sizes: Dict[str, int] = {}
        self.accepted: "OrderedDict[str, None]" = OrderedDict()  # kernel websocket execute_request msg_ids

    def accept(self, msg_id: str) -> bool:
        """False if this websocket execute_request was accepted before (a client resending after a
        reconnect): the kernel does not get it again; the fan-out's replay serves its output."""
        if msg_id in self.accepted:
            return False
        self.accepted[msg_id] = None
        while len(self.accepted) > self.max_ids:
            self.accepted.popitem(last=False)
        return True

    def forget(self, msg_id: str) -> None:
        """Refused, not run: a resend may run it."""
        self.accepted.pop(msg_id, None)

    @staticmethod
    def valid(execution_id: str) -> bool:
        return bool(_ID.match(execution_id))

    async def run(self, execution_id: Optional[str], start: Callable[[OutputCallback], Awaitable[dict]],
                  on_output: Optional[OutputCallback] = None, on_begin: Optional[BeginCallback] = None) -> dict:
        """``start(on_output)`` runs the cell; it is called at most once per remembered id.
        ``on_begin`` hears how the id is served before any output: a caller retrying after a
        lost node learns whether it joined the run it saw or got a new one (the lost run died
        with its node, so the cell runs again from the sandbox's checkpoint)."""
        if execution_id is None:
            return await start(on_output or _ignore)
        if execution_id in self.finished:
            result = self.finished[execution_id]
            if result is None:
                raise Conflict(f"execution {execution_id} already ran; its result is no longer kept",
                               code="execution_expired")
            if on_begin:
                await on_begin("finished")
            if on_output:
                for out in result["outputs"]:
                    await on_output(out)
            return result
        running = self.running.get(execution_id)
        if running is not None:  # join: what it said so far, then live
            if on_begin:
                await on_begin("joined")
            if on_output:
                for out in list(running.outputs):
                    await on_output(out)
                running.listeners.append(on_output)
            try:
                return await asyncio.shield(running.done)
            finally:
                if on_output in running.listeners:
                    running.listeners.remove(on_output)
        running = self.running[execution_id] = _Running()
        if on_output:
            running.listeners.append(on_output)
        try:
            if on_begin:
                await on_begin("new")
            result = await start(running.output)
        except BaseException as e:
            # Not run to an answer (no kernel, cancelled): a retry may run it. Joiners get the error.
            del self.running[execution_id]
            if not running.done.done():
                running.done.set_exception(e if isinstance(e, Exception) else Conflict("execution cancelled"))
                running.done.exception()  # retrieved: no "never retrieved" warning when nobody joined
            raise
        del self.running[execution_id]
        self.remember(execution_id, result)
        running.done.set_result(result)
        return result

    def remember(self, execution_id: str, result: Optional[dict]) -> None:
        self.finished[execution_id] = result
        self.finished.move_to_end(execution_id)
        self._sizes[execution_id] = len(json.dumps(result)) if result is not None else 0
        while len(self.finished) > self.max_ids:
            old, _ = self.finished.popitem(last=False)
            self._sizes.pop(old, None)
        total = sum(self._sizes.values())
        for old in list(self.finished):  # oldest results go first; their ids stay as "ran"
            if total <= self.max_bytes:
                break
            if self.finished[old] is not None:
                total -= self._sizes[old]
                self.finished[old], self._sizes[old] = None, 0

    # -- checkpoint metadata ------------------------------------------------------------------
    def to_record(self) -> dict:
        """What travels with a checkpoint: finished ids and their kept results (running ones
        have no answer yet; a retry of one after a take-over may run it)."""
        return {"finished": [[k, v] for k, v in self.finished.items()]}

    @classmethod
    def from_record(cls, record: Optional[dict], **kw) -> "Executions":
        ex = cls(**kw)
        for k, v in (record or {}).get("finished", []):
            if isinstance(k, str) and cls.valid(k):
                ex.remember(k, v if isinstance(v, dict) else None)
        return ex


async def _ignore(out: dict) -> None:
    return None
