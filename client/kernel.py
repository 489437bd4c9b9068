"""The kernel websocket (``/api/kernels/{id}/channels``, Jupyter messages in the legacy
JSON format or the ``v1.kernel.websocket.jupyter.org`` subprotocol), with reconnect: a dropped
connection is reopened with the same session id, and the gateway replays what it buffered
meanwhile (docs/api.md)."""

from __future__ import annotations

import time
import uuid
from typing import Any, Callable, Optional

import websocket

from . import _api as api
from . import _wire as wire
from ._wire import V1, output_of  # noqa: F401 (public here too: callers import them from this module)
from .errors import AuthError, NotFound, SandgateError, Timeout, Unavailable, error_from
from .models import Execution

_DROPPED = (websocket.WebSocketConnectionClosedException, ConnectionError, BrokenPipeError, OSError)


class KernelConnection:
    """One websocket to a sandbox's kernel. ``execute`` runs a cell and streams its
    output to callbacks; ``send``/``recv`` speak raw Jupyter messages.

    ``session``: the session id to connect with and put in every header (a new one if not
    given); the gateway sends a request's replies to the connection of its session (docs/api.md).
    ``protocol``: ``"legacy"`` (JSON text frames) or ``"v1"`` (asks for the
    ``v1.kernel.websocket.jupyter.org`` subprotocol; ``self.protocol`` says what was
    agreed). ``on_message``: called with every message received, in order, before
    anything else looks at it. ``max_reconnects=0``: a dropped connection is raised
    (``Unavailable``), not reopened."""

    def __init__(self, url: Optional[str], token: Optional[str], kernel_id: str, timeout: float = 30.0,
                 session: Optional[str] = None, max_reconnects: int = 5, protocol: str = "legacy",
                 on_message: Optional[Callable[[dict], Any]] = None):
        self._subprotocols = wire.check_protocol(protocol)
        url, self.token = api.settings(url, token)
        self.ws_url = url.replace("http://", "ws://", 1).replace("https://", "wss://", 1)
        self.http_url = url
        self.kernel_id = kernel_id
        self.session = session or uuid.uuid4().hex
        self.protocol = protocol
        self.on_message = on_message
        self.timeout = timeout
        self.max_reconnects = max_reconnects
        self.reconnects = 0  # how many times the connection was reopened
        self.ws: Optional[websocket.WebSocket] = None
        self._connect(timeout)

    def _connect(self, timeout: float) -> None:
        url = f"{self.ws_url}/api/kernels/{self.kernel_id}/channels?session_id={self.session}"
        header = [f"Authorization: token {self.token}"] if self.token else []
        try:
            self.ws = websocket.create_connection(url, header=header, timeout=timeout,
                                                  subprotocols=self._subprotocols)
        except websocket.WebSocketBadStatusException as e:
            raise error_from(e.status_code, e.resp_body or b"", e.resp_headers) from e
        except websocket.WebSocketTimeoutException as e:
            raise Timeout(f"websocket to {self.kernel_id}: no answer in {timeout:g} s", code="timeout") from e
        except OSError as e:
            raise Unavailable(f"cannot reach the gateway at {self.http_url}: {e}", code="unreachable") from e
        if self._subprotocols and self.ws.subprotocol != wire.V1:
            self.ws.close()
            raise Unavailable(f"the server at {self.http_url} did not agree to the {wire.V1} subprotocol",
                              code="protocol")

    def _reconnect(self, deadline: float) -> None:
        delay = 0.1
        while True:
            if self.reconnects >= self.max_reconnects:
                raise Unavailable(f"websocket to {self.kernel_id} dropped (after {self.reconnects} reconnects); "
                                  "giving up",
                                  code="unreachable")
            self.reconnects += 1
            try:
                self.ws.close()
            except Exception:
                pass
            left = deadline - time.monotonic()
            if left <= 0:
                raise Timeout(f"websocket to {self.kernel_id}: could not reconnect in time", code="timeout")
            try:
                self._connect(min(left, self.timeout))
                return
            except (AuthError, NotFound):
                raise  # the kernel is gone, or the token no longer works: retrying cannot help
            except SandgateError:
                time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
                delay = min(delay * 2, 2.0)

    def drop(self) -> None:
        """Cut the connection without a close handshake, as a network failure would
        (for tests and for callers that know the connection is stale)."""
        try:
            self.ws.sock.shutdown(2)
        except OSError:
            pass

    def send(self, msg_type: str, content: dict, channel: str = "shell", parent: Optional[dict] = None,
             metadata: Optional[dict] = None, buffers: Optional[list] = None) -> str:
        """Send one Jupyter message; its msg_id."""
        header = wire.header(msg_type, self.session)
        frame = wire.encode(self.protocol, channel, header, parent, content, metadata, buffers)
        try:
            self._send(frame)
        except _DROPPED:
            self._reconnect(time.monotonic() + self.timeout)
            self._send(frame)
        return header["msg_id"]

    def _send(self, frame) -> None:
        if isinstance(frame, bytes):
            self.ws.send_binary(frame)
        else:
            self.ws.send(frame)

    def recv(self, timeout: Optional[float] = None) -> dict:
        """The next message (reconnecting, with replay, if the connection drops): a dict with
        ``channel``, ``header``, ``msg_type``, ``parent_header``, ``metadata``, ``content``, ``buffers``."""
        deadline = time.monotonic() + (timeout if timeout is not None else self.timeout)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise Timeout(f"no message from kernel {self.kernel_id} in time", code="timeout")
            try:
                self.ws.settimeout(left)
                opcode, data = self.ws.recv_data()
            except websocket.WebSocketTimeoutException as e:
                raise Timeout(f"no message from kernel {self.kernel_id} in time", code="timeout") from e
            except _DROPPED:
                self._reconnect(deadline)
                continue
            if opcode == websocket.ABNF.OPCODE_CLOSE or not data:
                self._reconnect(deadline)
                continue
            m = wire.decode(self.protocol, data if opcode == websocket.ABNF.OPCODE_BINARY else data.decode())
            if self.on_message is not None:
                self.on_message(m)
            return m

    def execute(self, code: str, *, on_stdout: Optional[Callable[[str], Any]] = None,
                on_stderr: Optional[Callable[[str], Any]] = None, on_result: Optional[Callable] = None,
                on_error: Optional[Callable] = None, on_output: Optional[Callable[[dict], Any]] = None,
                on_input: Optional[Callable[[str, bool], str]] = None, timeout: float = 60.0) -> Execution:
        """Run a cell over the websocket; as ``Sandbox.run_code``. Past ``timeout`` the
        kernel is interrupted and ``Timeout`` raised. ``on_input(prompt, password)``: the
        cell may call ``input()``; what it returns is the answer (without it, input() fails)."""
        msg_id = self.send("execute_request", wire.execute_content(code, on_input is not None))
        return self.wait(msg_id, timeout=timeout, on_input=on_input,
                         callbacks=api.Callbacks(on_stdout, on_stderr, on_result, on_error, on_output))

    def wait(self, msg_id: str, timeout: float = 60.0, callbacks: Optional[api.Callbacks] = None,
             on_input: Optional[Callable[[str, bool], str]] = None) -> Execution:
        """Collect the output and reply of the request ``msg_id`` until the kernel is idle.
        The Execution's ``messages`` are the request's raw messages, ``reply`` its reply's content."""
        col = wire.Collector(self.kernel_id, msg_id, callbacks, on_input)
        deadline = time.monotonic() + timeout
        while not col.done:
            try:
                m = self.recv(max(0.0, deadline - time.monotonic()))
            except Timeout:
                if col.interrupted:
                    break  # interrupted, and still no reply: give up waiting
                self._interrupt()
                # Wait (briefly) for the interrupted cell to end, or ipykernel would
                # abort the next request as part of the failed cell's queue.
                col.interrupted, deadline = True, time.monotonic() + 10
                continue
            ask = col.feed(m)
            if ask is not None and on_input is not None:
                c = ask.get("content") or {}
                self.send("input_reply", {"value": on_input(c.get("prompt", ""), bool(c.get("password")))},
                          channel="stdin", parent=ask["header"])
        return col.finish(timeout)

    def _interrupt(self) -> None:
        from .sandbox import HTTP
        try:
            HTTP(self.http_url, self.token, timeout=10).call(
                api.Call("POST", f"/api/kernels/{self.kernel_id}/interrupt", b"{}", (204,), lambda b: None))
        except SandgateError:
            pass

    def close(self) -> None:
        if self.ws is not None:
            self.ws.close()

    def __enter__(self) -> "KernelConnection":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
