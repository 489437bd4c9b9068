"""Fan-out of one kernel's messages to the clients attached to it, and the
replay buffer that keeps them while none is attached (jupyter_server's
ZMQChannelsWebsocketConnection plays this part per connection; here it is per
sandbox, so a reconnecting client gets what it missed)."""

from __future__ import annotations

import collections
import json
import logging
from typing import List, Optional, Protocol

log = logging.getLogger("sandgate.fanout")


class Listener(Protocol):
    """A client attached to a sandbox's kernel (a websocket, an execute call)."""

    session_ids: set
    replay: bool  # whether it takes the replay buffer when it attaches

    def deliver(self, channel: str, parts: List[bytes]) -> None: ...


class FanOut:
    REPLAY_BYTES = 64 << 20

    def __init__(self, sandbox_id: str, replay_messages: int):
        self.sandbox_id = sandbox_id
        self.max_messages = replay_messages
        self.listeners: List[Listener] = []
        self.replay: collections.deque = collections.deque()
        self.replay_bytes = 0
        self.dropped = 0

    def __len__(self) -> int:
        return len(self.listeners)

    def clear(self) -> None:
        self.replay.clear()
        self.replay_bytes = self.dropped = 0

    def attach(self, conn: Listener) -> None:
        self.listeners.append(conn)
        if not getattr(conn, "replay", True):
            return
        replay, self.replay, self.replay_bytes = self.replay, collections.deque(), 0
        if self.dropped:
            log.warning("sandbox %s: %d messages dropped while no client was connected", self.sandbox_id, self.dropped)
            self.dropped = 0
        for channel, parts in replay:
            conn.deliver(channel, parts)

    def detach(self, conn: Listener) -> None:
        if conn in self.listeners:
            self.listeners.remove(conn)

    def _keep(self, channel: str, parts: List[bytes]) -> None:
        size = sum(len(p) for p in parts)
        if len(self.replay) >= self.max_messages or self.replay_bytes + size > self.REPLAY_BYTES:
            self.dropped += 1
            return
        self.replay.append((channel, parts))
        self.replay_bytes += size

    def broadcast(self, channel: str, parts: List[bytes]) -> None:
        """iopub: to every client."""
        if not self.listeners:
            self._keep(channel, parts)
        for conn in list(self.listeners):
            conn.deliver(channel, parts)

    def reply(self, channel: str, parts: List[bytes]) -> None:
        """shell, control, stdin: to the client whose session asked (all if none matches)."""
        if not self.listeners:
            self._keep(channel, parts)
            return
        try:
            session = json.loads(parts[1]).get("session")
        except (ValueError, AttributeError, IndexError):
            session = None
        # No client of that session: any websocket client (not an execute
        # call's collector), else the replay buffer for the one that reconnects.
        targets = ([c for c in self.listeners if session in c.session_ids]
                   or [c for c in self.listeners if getattr(c, "replay", True)])
        if not targets:
            self._keep(channel, parts)
        for conn in targets:
            conn.deliver(channel, parts)

    def route(self, channel: str, parts: List[bytes]) -> None:
        (self.broadcast if channel == "iopub" else self.reply)(channel, parts)


class IopubLimiter:
    """jupyter_server's iopub rate limit, per client: over a sliding window,
    past ``msg_rate`` messages/s or ``data_rate`` stream bytes/s, iopub
    messages other than status are dropped (the client is told once, on
    stderr) until the rate falls below 80% of the limit again."""

    def __init__(self, msg_rate: float, data_rate: float, window: float = 3.0):
        self.msg_rate, self.data_rate, self.window = msg_rate, data_rate, window
        self.queue: collections.deque = collections.deque()  # (expiry, bytes)
        self.msgs = self.bytes = 0
        self.msgs_exceeded = self.data_exceeded = False
        self.dropped = 0

    def drop(self, parts: List[bytes], now: float) -> Optional[str]:
        """None to deliver; "drop" to drop; a notice (str) to deliver instead, once."""
        if b'"status"' in parts[0]:
            try:
                if json.loads(parts[0]).get("msg_type") == "status":
                    return None  # never dropped: clients wait for idle
            except (ValueError, AttributeError):
                pass
        while self.queue and now >= self.queue[0][0]:
            _, n = self.queue.popleft()
            self.msgs -= 1
            self.bytes -= n
        size = sum(len(p) for p in parts) if b'"stream"' in parts[0] else 0
        self.msgs += 1
        self.bytes += size
        self.queue.append((now + self.window, size))
        was = self.msgs_exceeded or self.data_exceeded
        msg_rate, data_rate = self.msgs / self.window, self.bytes / self.window
        if self.msg_rate and msg_rate > self.msg_rate:
            self.msgs_exceeded = True
        elif self.msgs_exceeded and msg_rate < 0.8 * self.msg_rate:
            self.msgs_exceeded = False
        if self.data_rate and data_rate > self.data_rate:
            self.data_exceeded = True
        elif self.data_exceeded and data_rate < 0.8 * self.data_rate:
            self.data_exceeded = False
        now_exceeded = self.msgs_exceeded or self.data_exceeded
        if now_exceeded and not was:
            self.dropped = 1
            what = (f"message rate exceeded ({self.msg_rate:g} messages/s)" if self.msgs_exceeded
                    else f"data rate exceeded ({self.data_rate:g} bytes/s of output)")
            return (f"IOPub {what}: the gateway drops this client's output until the rate falls "
                    f"(SANDGATE_IOPUB_MSG_RATE, SANDGATE_IOPUB_DATA_RATE)\n")
        if now_exceeded:
            self.dropped += 1
            return "drop"
        if was:
            log.warning("iopub output resumed after %d messages were dropped for one client", self.dropped)
        return None
