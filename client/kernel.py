"""The kernel websocket (``/api/kernels/{id}/channels``, Jupyter messages in the
legacy JSON format), with reconnect: a dropped connection is reopened with the same
session id, and the gateway replays what it buffered meanwhile (docs/api.md)."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Callable, Optional

import websocket

from . import _api as api
from .errors import AuthError, NotFound, SandboxDied, SandgateError, Timeout, Unavailable, error_from
from .models import Execution, ExecutionError

_DROPPED = (websocket.WebSocketConnectionClosedException, ConnectionError, BrokenPipeError, OSError)


def output_of(msg_type: str, content: dict) -> Optional[dict]:
    """A Jupyter iopub message as the sandbox API's output dict."""
    if msg_type == "stream":
        return {"type": "stream", "name": content.get("name"), "text": content.get("text", "")}
    if msg_type in ("execute_result", "display_data"):
        return {"type": msg_type, "data": content.get("data", {}), "metadata": content.get("metadata", {})}
    if msg_type == "error":
        return {"type": "error", "ename": content.get("ename"), "evalue": content.get("evalue"),
                "traceback": content.get("traceback", [])}
    return None


class KernelConnection:
    """One websocket to a sandbox's kernel. ``execute`` runs a cell and streams its
    output to callbacks; ``send``/``recv`` speak raw Jupyter messages."""

    def __init__(self, url: Optional[str], token: Optional[str], kernel_id: str, timeout: float = 30.0,
                 session: Optional[str] = None, max_reconnects: int = 5):
        url, self.token = api.settings(url, token)
        self.ws_url = url.replace("http://", "ws://", 1).replace("https://", "wss://", 1)
        self.http_url = url
        self.kernel_id = kernel_id
        self.session = session or uuid.uuid4().hex
        self.timeout = timeout
        self.max_reconnects = max_reconnects
        self.reconnects = 0  # how many times the connection was reopened
        self.ws: Optional[websocket.WebSocket] = None
        self._connect(timeout)

    def _connect(self, timeout: float) -> None:
        url = f"{self.ws_url}/api/kernels/{self.kernel_id}/channels?session_id={self.session}"
        header = [f"Authorization: token {self.token}"] if self.token else []
        try:
            self.ws = websocket.create_connection(url, header=header, timeout=timeout)
        except websocket.WebSocketBadStatusException as e:
            raise error_from(e.status_code, e.resp_body or b"", e.resp_headers) from e
        except websocket.WebSocketTimeoutException as e:
            raise Timeout(f"websocket to {self.kernel_id}: no answer in {timeout:g} s", code="timeout") from e
        except OSError as e:
            raise Unavailable(f"cannot reach the gateway at {self.http_url}: {e}", code="unreachable") from e

    def _reconnect(self, deadline: float) -> None:
        delay = 0.1
        while True:
            if self.reconnects >= self.max_reconnects:
                raise Unavailable(f"websocket to {self.kernel_id} dropped {self.reconnects} times; giving up",
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

    def send(self, msg_type: str, content: dict, channel: str = "shell", parent: Optional[dict] = None) -> str:
        header = {"msg_id": uuid.uuid4().hex, "msg_type": msg_type, "session": self.session,
                  "username": "sandgate-client", "date": time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime()),
                  "version": "5.3"}
        frame = json.dumps({"header": header, "parent_header": parent or {}, "metadata": {}, "content": content,
                            "channel": channel})
        try:
            self.ws.send(frame)
        except _DROPPED:
            self._reconnect(time.monotonic() + self.timeout)
            self.ws.send(frame)
        return header["msg_id"]

    def recv(self, timeout: Optional[float] = None) -> dict:
        """The next message (reconnecting, with replay, if the connection drops)."""
        deadline = time.monotonic() + (timeout if timeout is not None else self.timeout)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise Timeout(f"no message from kernel {self.kernel_id} in time", code="timeout")
            try:
                self.ws.settimeout(left)
                data = self.ws.recv()
            except websocket.WebSocketTimeoutException as e:
                raise Timeout(f"no message from kernel {self.kernel_id} in time", code="timeout") from e
            except _DROPPED:
                self._reconnect(deadline)
                continue
            if not data:  # a close frame
                self._reconnect(deadline)
                continue
            return json.loads(data)

    def execute(self, code: str, *, on_stdout: Optional[Callable[[str], Any]] = None,
                on_stderr: Optional[Callable[[str], Any]] = None, on_result: Optional[Callable] = None,
                on_error: Optional[Callable] = None, on_output: Optional[Callable[[dict], Any]] = None,
                timeout: float = 60.0) -> Execution:
        """Run a cell over the websocket; as ``Sandbox.run_code``. Past ``timeout`` the
        kernel is interrupted and ``Timeout`` raised."""
        msg_id = self.send("execute_request", {"code": code, "silent": False, "store_history": True,
                                               "user_expressions": {}, "allow_stdin": False, "stop_on_error": True})
        return self.wait(msg_id, timeout=timeout, callbacks=api.Callbacks(on_stdout, on_stderr, on_result,
                                                                            on_error, on_output))

    def wait(self, msg_id: str, timeout: float = 60.0, callbacks: Optional[api.Callbacks] = None) -> Execution:
        """Collect the output and reply of the request ``msg_id`` until the kernel is idle."""
        cb = callbacks or api.Callbacks()
        reply, idle, interrupted = None, False, False
        deadline = time.monotonic() + timeout
        while not (reply is not None and idle):
            try:
                m = self.recv(max(0.0, deadline - time.monotonic()))
            except Timeout:
                if interrupted:
                    break  # interrupted, and still no reply: give up waiting
                self._interrupt()
                # Wait (briefly) for the interrupted cell to end, or ipykernel would
                # abort the next request as part of the failed cell's queue.
                interrupted, deadline = True, time.monotonic() + 10
                continue
            if (m.get("parent_header") or {}).get("msg_id") != msg_id:
                continue
            t, c = m.get("msg_type") or m["header"]["msg_type"], m.get("content") or {}
            if t == "execute_reply":
                reply = c
            elif t == "status":
                if c.get("execution_state") == "dead":
                    err = SandboxDied(f"kernel {self.kernel_id} is dead", code="conflict", state="dead")
                    err.execution = cb.live
                    raise err
                idle = c.get("execution_state") == "idle"
            else:
                out = output_of(t, c)
                if out:
                    cb.output(out)
        ex = cb.live
        if interrupted:
            ex.status = "timeout"
            return api.finish(ex, timeout)
        ex.execution_count = reply.get("execution_count")
        ex.status = {"error": "error", "aborted": "aborted"}.get(reply.get("status"), "ok")
        if ex.status == "aborted":  # ipykernel dropped it: an earlier cell failed or was interrupted
            ex.error = ExecutionError("Aborted", "the kernel aborted this request (an earlier request in its queue "
                                                 "failed or was interrupted)")
        if reply.get("status") == "error" and ex.error is None:
            ex.error = ExecutionError(reply.get("ename", ""), reply.get("evalue", ""), reply.get("traceback", []))
        return api.finish(ex, timeout)

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
