"""The kernel websocket, ``/api/kernels/{id}/channels``.

One connection is one listener on a sandbox's kernel (core/fanout.py): it gets
every iopub message and the replies to its own requests. The wire format is
legacy JSON unless the client offers the v1 subprotocol. A frame that is not
a Jupyter message is logged and ignored; the connection stays usable (Kernel
Gateway drops the connection instead). Frames over the size bound close the
connection with status 1009, as tornado does.
"""

from __future__ import annotations

import json
import logging
import time
from typing import List

from tornado import httpclient, web, websocket
from tornado.ioloop import IOLoop

from ..core.errors import Conflict, NotFound, TooLarge
from ..core.fanout import IopubLimiter
from ..core.messages import error_reply, message, status_message
from . import wire
from .. import trace
from ..logformat import new_request_id
from .base import AuthMixin
from .forward import Relay

log = logging.getLogger("sandgate.channels")
STALLED = 5.0  # seconds over its buffer bound without a byte reaching the socket: it stopped reading
# While the gateway's client budget is spent, a client holding output it has not drained for this long
# goes at the next message: waiting STALLED lets every non-reading client of a chatty kernel take its
# whole bound first (16 of them made the gateway 630 MiB larger in `sandgate bench --hostile`).
SPENT_STALLED = 0.5


class ChannelsHandler(AuthMixin, websocket.WebSocketHandler):
    kernel = None
    relay = None  # a Relay when the kernel lives on another node of the fleet
    v1 = False
    replay = True  # this client takes what the kernel said while nobody listened
    pending_bytes = 0  # written to tornado but not yet to the socket
    drained = 0.0  # when some of it last reached the socket
    _stall_check = None

    async def get(self, kernel_id):
        # Refuse before the upgrade, so clients see a real HTTP status.
        new_request_id(self.request.headers.get("X-Request-Id"))
        self.set_cors()
        self.who = await self.authenticate()
        if self.who is None:
            raise web.HTTPError(401)
        peer = await self.remote_node()
        if peer:  # on another node: this websocket is relayed there, frame by frame
            url = peer.url
            self.relay = Relay(self, peer)
            offered = [p.strip() for p in self.request.headers.get("Sec-WebSocket-Protocol", "").split(",")]
            try:
                await self.relay.connect(self.select_subprotocol(offered))
            except httpclient.HTTPClientError as e:
                if e.code < 599:  # the node answered (the kernel went meanwhile, say): its status
                    raise web.HTTPError(e.code, "%s", f"the node holding this kernel ({url}) answered: {e}") from None
                raise self._unreachable(kernel_id, url, e) from None
            except Exception as e:
                raise self._unreachable(kernel_id, url, e) from None
            try:
                await super().get(kernel_id)  # returns once the websocket is over, or was refused
            finally:
                self.relay.close()  # a refused handshake (origin, headers) never reaches on_close
            return
        try:
            self.kernel = self.settings["service"].get(kernel_id, self.who)  # another tenant's: 404 too
        except NotFound:
            raise web.HTTPError(404, "Kernel does not exist: %s", kernel_id) from None
        cap = self.settings["sandgate"].max_clients_per_kernel
        if self.clients() >= cap:
            raise web.HTTPError(403, "%s", f"kernel {kernel_id} has {self.clients()} websocket clients, the most this "
                                f"gateway allows (SANDGATE_MAX_CLIENTS_PER_KERNEL={cap}); close one first")
        self.session_ids = set()
        sid = self.get_query_argument("session_id", None)
        if sid:
            self.session_ids.add(sid)
        await super().get(kernel_id)

    def clients(self) -> int:
        """Websockets on this kernel (an execute call's collector is not one)."""
        return sum(1 for c in self.kernel.fanout.listeners if isinstance(c, ChannelsHandler))

    @staticmethod
    def _unreachable(kernel_id: str, url: str, e: Exception) -> web.HTTPError:
        log.warning("kernel %s: cannot relay to its node at %s: %s", kernel_id, url, e)
        return web.HTTPError(503, "%s", f"the node holding this kernel ({url}) is unreachable: {e}")

    def write_error(self, status_code, **kwargs):
        exc = kwargs.get("exc_info", (None, None, None))[1]
        message = exc.log_message % exc.args if isinstance(exc, web.HTTPError) and exc.log_message else ""
        self.set_header("Content-Type", "application/json")
        self.finish({"reason": self._reason, "message": message})

    def check_origin(self, origin):
        allow = self.settings["sandgate"].allow_origin
        return allow == "*" or origin == allow or super().check_origin(origin)

    def select_subprotocol(self, subprotocols):
        return wire.V1 if wire.V1 in subprotocols else None

    async def open(self, kernel_id):
        if self.relay:
            self.relay.start()
            return
        # Without it, Nagle and delayed ACKs add tens of ms to every small reply.
        self.set_nodelay(True)
        self.v1 = self.selected_subprotocol == wire.V1
        s = self.settings["sandgate"]
        self.limiter = IopubLimiter(s.iopub_msg_rate, s.iopub_data_rate)
        self.max_pending = s.client_buffer_mb << 20
        self.drained = time.monotonic()
        self.budget = self.settings["budget"]
        cap = s.max_clients_per_kernel
        if self.clients() >= cap:  # others were let in between this one's check and its handshake
            log.warning("kernel %s: refusing a websocket: %d clients already (SANDGATE_MAX_CLIENTS_PER_KERNEL)",
                        kernel_id, cap)
            self.close(1008, f"too many clients on this kernel (SANDGATE_MAX_CLIENTS_PER_KERNEL={cap})")
            return
        self.kernel.attach(self)
        if self.kernel.execution_state == "dead":
            self.deliver("iopub", status_message("dead"))
        log.info("websocket open on kernel %s (%s)", kernel_id, "v1" if self.v1 else "legacy")

    def on_message(self, message):
        if self.relay:
            self.relay.send(message)
            return
        try:
            channel, parts, header = (wire.decode_v1 if self.v1 else wire.decode_legacy)(message)
        except wire.WireError as e:
            log.warning("kernel %s: ignoring a bad websocket frame: %s", self.kernel.id, e)
            return
        if header.get("session"):
            self.session_ids.add(header["session"])
        trace.ws_received(header)
        try:
            self.kernel.send(channel, parts, header)
        except Conflict as e:
            log.warning("kernel %s: message not delivered: %s", self.kernel.id, e)
            self.deliver("iopub", status_message("dead", header))
        except TooLarge as e:  # told like a refused request, and the connection stays usable
            log.warning("kernel %s: message not delivered: %s", self.kernel.id, e)
            if header.get("msg_type") == "execute_request":
                self.deliver("shell", error_reply(header, "MessageTooLarge", str(e)))
                self.deliver("iopub", status_message("idle", header))

    def deliver(self, channel: str, parts: List[bytes]) -> None:
        if self.ws_connection is None or self.ws_connection.is_closing():
            return
        if channel == "iopub":
            verdict = self.limiter.drop(parts, time.monotonic())
            if verdict == "drop":
                return
            if verdict:  # the one notice, in place of the message, as jupyter_server does
                log.warning("kernel %s: %s", self.kernel.id, verdict.strip())
                parts = message("stream", {"name": "stderr", "text": verdict}, _parent(parts))
        data = wire.encode_v1(channel, parts) if self.v1 else wire.encode_legacy(channel, parts)
        if not self.pending_bytes:  # nothing was waiting: its stall clock starts now, not at its last drain
            self.drained = time.monotonic()
        elif self.budget.spent() and time.monotonic() - self.drained > SPENT_STALLED:
            self._drop()
            return
        if self._over(len(data)):
            if self.pending_bytes > 4 * self.max_pending or time.monotonic() - self.drained > STALLED:
                self._drop()
                return
            if self._stall_check is None:  # over the bound: gone for good unless it drains soon
                self._stall_check = IOLoop.current().call_later(STALLED, self._check_stalled)
        try:
            sent = self.write_message(data, binary=isinstance(data, bytes))
        except websocket.WebSocketClosedError:
            return
        self.pending_bytes += len(data)
        self.budget.take(len(data))
        sent.add_done_callback(lambda _f, n=len(data): self._written(n))

    def _written(self, n: int) -> None:
        self.pending_bytes -= n
        self.budget.give(n)
        self.drained = time.monotonic()

    def _over(self, more: int = 0) -> bool:
        """Over its own bound, or holding unsent output while the gateway's client budget is spent
        (then a client that drains nothing for STALLED goes, as over its own bound)."""
        return self.pending_bytes + more > self.max_pending or (self.pending_bytes > 0 and self.budget.spent())

    def _check_stalled(self) -> None:
        self._stall_check = None
        if self._over() and time.monotonic() - self.drained >= STALLED:
            self._drop()

    def _drop(self) -> None:
        """It stopped reading (nothing drained for a while), or fell hopelessly
        behind: its messages would pile up in this process. Dropped, with a
        close it can see; other clients are not affected."""
        if self.ws_connection is None or self.ws_connection.is_closing():
            return
        log.warning("kernel %s: closing a websocket that stopped reading (%d MiB unsent)", self.kernel.id,
                    self.pending_bytes >> 20)
        self.kernel.detach(self)
        self.close(1008, "client too slow: output not read")

    def on_close(self):
        if self.relay:
            self.relay.close()
        if self.kernel:
            self.kernel.detach(self)


def _parent(parts: List[bytes]) -> dict:
    try:
        return json.loads(parts[1])
    except (ValueError, IndexError):
        return {}
