"""The asyncio client: ``AsyncSandbox`` (tornado's HTTP client; tornado is the gateway's
own dependency) with the same calls, results and errors as ``Sandbox``, and
``AsyncKernelConnection`` over the kernel websocket, with reconnect and replay."""

from __future__ import annotations

import asyncio
import inspect
import time
import uuid
from typing import Any, Callable, List, Optional
from urllib.parse import urlsplit

from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest
from tornado.simple_httpclient import HTTPTimeoutError
from tornado.websocket import WebSocketClosedError, websocket_connect

from . import _api as api
from . import _wire as wire
from .errors import (AuthError, Conflict, NotFound, SandboxDied, SandgateError, Timeout, Unavailable,
                     error_from)
from .models import Checkpoint, Execution, FileEntry, SandboxInfo


class AsyncHTTP:
    def __init__(self, url: Optional[str] = None, token: Optional[str] = None, timeout: float = api.DEFAULT_TIMEOUT):
        self.url, self.token = api.settings(url, token)
        self.timeout = timeout

    def _request(self, call: api.Call, timeout: float, **kw) -> HTTPRequest:
        headers = {"Content-Type": "application/json", **call.headers}
        if self.token:
            headers["Authorization"] = f"token {self.token}"
        body = call.body
        if body is None and call.method in ("POST", "PUT", "PATCH"):
            body = b""
        return HTTPRequest(self.url + call.path, method=call.method, body=body, headers=headers,
                           connect_timeout=timeout, request_timeout=timeout, decompress_response=False, **kw)

    async def _fetch(self, call: api.Call, timeout: float, **kw):
        client = AsyncHTTPClient()
        try:
            # The client's own timeout, and ours around it in case a stream trickles.
            return await asyncio.wait_for(client.fetch(self._request(call, timeout, **kw), raise_error=False),
                                          timeout + 5)
        except (HTTPTimeoutError, asyncio.TimeoutError) as e:
            raise Timeout(f"{call.method} {call.path}: no answer in {timeout:g} s", code="timeout") from e
        except (HTTPClientError, OSError) as e:
            raise Unavailable(f"cannot reach the gateway at {self.url}: {e}", code="unreachable") from e

    async def call(self, call: api.Call) -> Any:
        timeout = call.timeout or self.timeout
        resp = await self._fetch(call, timeout)
        if resp.code == 599:
            raise Unavailable(f"the gateway at {self.url}: {resp.error}", code="unreachable")
        if resp.code not in call.ok:
            raise error_from(resp.code, resp.body or b"", resp.headers)
        api.check_kind(call, resp.headers.get("Content-Type", ""))
        return call.parse(resp.body or b"")

    async def stream(self, call: api.Call, cb: api.Callbacks) -> Execution:
        timeout = call.timeout or self.timeout
        parser, raw, ended = api.SSEParser(), bytearray(), []

        def on_chunk(chunk: bytes) -> None:
            raw.extend(chunk[: max(0, 65536 - len(raw))])  # kept for an error answer's body
            if ended:
                return
            for event, data in parser.feed(chunk):
                try:
                    done = api.stream_event(cb, event, data)
                except SandgateError as e:
                    ended.append(e)
                    return
                if done is not None:
                    ended.append(done)
                    return
            # A coroutine callback runs now, not at the end.
            cb.pending[:] = [asyncio.ensure_future(p) if inspect.isawaitable(p) and not isinstance(p, asyncio.Future)
                             else p for p in cb.pending]

        resp = await self._fetch(call, timeout, streaming_callback=on_chunk)
        if cb.pending:
            await asyncio.gather(*cb.pending)
        if resp.code != 200:
            if resp.code == 599:
                raise Unavailable(f"the gateway at {self.url} dropped the execute stream: {resp.error}",
                                  code="unreachable")
            raise error_from(resp.code, bytes(raw), resp.headers)
        if not ended:
            raise api.incomplete()
        if isinstance(ended[0], SandgateError):
            raise ended[0]
        return ended[0]


class AsyncFiles:
    def __init__(self, sb: "AsyncSandbox"):
        self._sb = sb

    async def write(self, path: str, data: bytes | str, timeout: Optional[float] = None) -> dict:
        return await self._sb._http.call(api.write_file(self._sb.id, path, data, timeout))

    async def read(self, path: str, timeout: Optional[float] = None) -> bytes:
        return await self._sb._http.call(api.read_file(self._sb.id, path, timeout))

    async def read_text(self, path: str, encoding: str = "utf-8", timeout: Optional[float] = None) -> str:
        return (await self.read(path, timeout)).decode(encoding)

    async def list(self, path: str = "", timeout: Optional[float] = None) -> List[FileEntry]:
        return await self._sb._http.call(api.list_files(self._sb.id, path, timeout))

    async def remove(self, path: str, timeout: Optional[float] = None) -> None:
        await self._sb._http.call(api.remove_file(self._sb.id, path, timeout))


class AsyncSandbox:
    """``async with await AsyncSandbox.create() as sb: (await sb.run_code("1+1")).text``;
    also ``async with AsyncSandbox.create() as sb`` (the creation is awaited on entry).
    The same methods as ``Sandbox``, awaited; callbacks may be coroutine functions."""

    def __init__(self, info: SandboxInfo, http_: AsyncHTTP):
        self._http = http_
        self.info = info
        self.id = info.id
        self.files = AsyncFiles(self)

    @classmethod
    def create(cls, url: Optional[str] = None, token: Optional[str] = None, **kw) -> "_Creating":
        """Start a sandbox; the arguments are ``Sandbox.create``'s. Await it, or use it
        directly in ``async with``."""
        return _Creating(cls._create(url, token, **kw))

    @classmethod
    async def _create(cls, url=None, token=None, *, driver=None, env=None, labels=None, limits=None, ttl=None,
                      checkpoint=None, egress=None, secrets=None, timeout=None) -> "AsyncSandbox":
        h = AsyncHTTP(url, token)
        info = await h.call(api.create(driver=driver, env=env, labels=labels, limits=limits, ttl=ttl,
                                       checkpoint=checkpoint, egress=egress, secrets=secrets, timeout=timeout))
        return cls(info, h)

    @classmethod
    def restore(cls, checkpoint: str, url: Optional[str] = None, token: Optional[str] = None, **kw) -> "_Creating":
        return cls.create(url, token, checkpoint=checkpoint, **kw)

    @classmethod
    async def connect(cls, sandbox_id: str, url: Optional[str] = None, token: Optional[str] = None,
                      timeout: Optional[float] = None) -> "AsyncSandbox":
        h = AsyncHTTP(url, token)
        return cls(await h.call(api.get(sandbox_id, timeout)), h)

    @classmethod
    async def list(cls, url: Optional[str] = None, token: Optional[str] = None,
                   timeout: Optional[float] = None) -> List[SandboxInfo]:
        return await AsyncHTTP(url, token).call(api.list_(timeout))

    async def refresh(self, timeout: Optional[float] = None) -> SandboxInfo:
        self.info = await self._http.call(api.get(self.id, timeout))
        return self.info

    async def run_code(self, code: str, *, on_stdout: Optional[Callable] = None, on_stderr: Optional[Callable] = None,
                       on_result: Optional[Callable] = None, on_error: Optional[Callable] = None,
                       on_output: Optional[Callable] = None, timeout: float = 60.0) -> Execution:
        cb = api.Callbacks(on_stdout, on_stderr, on_result, on_error, on_output)
        # One id for every try: a retry after a lost node joins the run or gets its result, never reruns it.
        eid, deadline, attempt = api.new_execution_id(), time.monotonic() + timeout + api.RUN_GRACE, 0
        while True:
            try:
                ex = await self._http.stream(api.execute(self.id, code, timeout, True, eid, deadline), cb)
                break
            except Conflict as e:
                raise await self._died(e, cb.live)
            except SandgateError as e:
                wait = api.retry_wait(e, attempt, deadline)
                if wait is None:
                    raise
                attempt += 1
                cb.rewind()
                await asyncio.sleep(wait)
        return api.finish(ex, timeout)

    async def _died(self, e: Conflict, live: Execution) -> Conflict:
        if isinstance(e, SandboxDied) or e.state is not None:
            return e
        try:
            state = (await self.refresh(10)).state
        except SandgateError:
            return e
        if state != "dead":
            return e
        died = SandboxDied(e.message, status=409, code=e.code, reason=e.reason, state="dead", body=e.body)
        died.execution = live
        return died

    async def checkpoint(self, name: str = "", timeout: Optional[float] = None) -> Checkpoint:
        return await self._http.call(api.checkpoint(self.id, name, timeout))

    async def checkpoints(self, timeout: Optional[float] = None) -> List[Checkpoint]:
        return await self._http.call(api.checkpoints(self.id, timeout))

    async def delete_checkpoint(self, checkpoint: str, timeout: Optional[float] = None) -> None:
        await self._http.call(api.delete_checkpoint(self.id, checkpoint, timeout))

    async def fork(self, checkpoint: Optional[str] = None, timeout: Optional[float] = None) -> "AsyncSandbox":
        return AsyncSandbox(await self._http.call(api.fork(self.id, checkpoint, timeout)), self._http)

    async def pause(self, mode: str = "disk", timeout: Optional[float] = None) -> SandboxInfo:
        self.info = await self._http.call(api.pause(self.id, mode, timeout))
        return self.info

    async def resume(self, timeout: Optional[float] = None) -> SandboxInfo:
        self.info = await self._http.call(api.resume(self.id, timeout))
        return self.info

    async def set_egress(self, allow: Optional[list] = None, deny: Optional[list] = None,
                         timeout: Optional[float] = None) -> SandboxInfo:
        self.info = await self._http.call(api.set_egress(self.id, {"allow": allow or [], "deny": deny or []}, timeout))
        return self.info

    async def kernel(self, timeout: float = 30.0, **options) -> "AsyncKernelConnection":
        k = AsyncKernelConnection(self._http.url, self._http.token, self.id, timeout=timeout, **options)
        await k.connect()
        return k

    async def delete(self, timeout: Optional[float] = None) -> None:
        await self._http.call(api.delete(self.id, timeout))

    kill = delete

    async def __aenter__(self) -> "AsyncSandbox":
        return self

    async def __aexit__(self, exc_type, *_) -> None:
        try:
            await self.delete()
        except NotFound:
            pass
        except SandgateError:
            if exc_type is None:
                raise

    def __repr__(self) -> str:
        return f"<AsyncSandbox {self.id} {self.info.state}>"


class _Creating:
    """What ``AsyncSandbox.create`` returns: awaitable, and an async context manager."""

    def __init__(self, coro):
        self._coro, self._sb = coro, None

    def __await__(self):
        return self._coro.__await__()

    async def __aenter__(self) -> AsyncSandbox:
        self._sb = await self._coro
        return self._sb

    async def __aexit__(self, *exc) -> None:
        await self._sb.__aexit__(*exc)


class AsyncKernelConnection:
    """The kernel websocket, asyncio (tornado's websocket client); as ``KernelConnection``
    (the same ``session``, ``protocol``, ``on_message`` and ``max_reconnects`` options)."""

    def __init__(self, url: Optional[str], token: Optional[str], kernel_id: str, timeout: float = 30.0,
                 session: Optional[str] = None, max_reconnects: int = 5, protocol: str = "legacy",
                 on_message: Optional[Callable[[dict], Any]] = None):
        self._subprotocols = wire.check_protocol(protocol)
        url, self.token = api.settings(url, token)
        u = urlsplit(url)
        self.ws_url = url.replace("http://", "ws://", 1).replace("https://", "wss://", 1) if u.scheme else url
        self.http_url = url
        self.kernel_id = kernel_id
        self.session = session or uuid.uuid4().hex
        self.protocol, self.on_message = protocol, on_message
        self.timeout, self.max_reconnects, self.reconnects = timeout, max_reconnects, 0
        self.ws = None

    async def connect(self, timeout: Optional[float] = None) -> None:
        timeout = timeout or self.timeout
        headers = {"Authorization": f"token {self.token}"} if self.token else {}
        req = HTTPRequest(f"{self.ws_url}/api/kernels/{self.kernel_id}/channels?session_id={self.session}",
                          headers=headers, connect_timeout=timeout, request_timeout=timeout)
        try:
            self.ws = await asyncio.wait_for(websocket_connect(req, subprotocols=self._subprotocols), timeout + 5)
        except HTTPClientError as e:
            if e.code == 599:
                raise Unavailable(f"cannot reach the gateway at {self.http_url}: {e}", code="unreachable") from e
            raise error_from(e.code, e.response.body if e.response is not None else b"",
                             e.response.headers if e.response is not None else None) from e
        except asyncio.TimeoutError as e:
            raise Timeout(f"websocket to {self.kernel_id}: no answer in {timeout:g} s", code="timeout") from e
        except OSError as e:
            raise Unavailable(f"cannot reach the gateway at {self.http_url}: {e}", code="unreachable") from e
        if self._subprotocols and self.ws.selected_subprotocol != wire.V1:
            self.ws.close()
            raise Unavailable(f"the server at {self.http_url} did not agree to the {wire.V1} subprotocol",
                              code="protocol")

    async def _reconnect(self, deadline: float) -> None:
        delay = 0.1
        while True:
            if self.reconnects >= self.max_reconnects:
                raise Unavailable(f"websocket to {self.kernel_id} dropped {self.reconnects} times; giving up",
                                  code="unreachable")
            self.reconnects += 1
            if self.ws is not None:
                self.ws.close()
            left = deadline - time.monotonic()
            if left <= 0:
                raise Timeout(f"websocket to {self.kernel_id}: could not reconnect in time", code="timeout")
            try:
                await self.connect(min(left, self.timeout))
                return
            except (AuthError, NotFound):
                raise
            except SandgateError:
                await asyncio.sleep(min(delay, max(0.0, deadline - time.monotonic())))
                delay = min(delay * 2, 2.0)

    def drop(self) -> None:
        """Cut the TCP connection without a close handshake (a network failure)."""
        stream = self.ws.protocol.stream if self.ws is not None and self.ws.protocol else None
        if stream is not None:
            stream.close()

    async def send(self, msg_type: str, content: dict, channel: str = "shell", parent: Optional[dict] = None,
                   metadata: Optional[dict] = None, buffers: Optional[list] = None) -> str:
        header = wire.header(msg_type, self.session)
        frame = wire.encode(self.protocol, channel, header, parent, content, metadata, buffers)
        try:
            await self.ws.write_message(frame, binary=isinstance(frame, bytes))
        except WebSocketClosedError:
            await self._reconnect(time.monotonic() + self.timeout)
            await self.ws.write_message(frame, binary=isinstance(frame, bytes))
        return header["msg_id"]

    async def recv(self, timeout: Optional[float] = None) -> dict:
        deadline = time.monotonic() + (timeout if timeout is not None else self.timeout)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise Timeout(f"no message from kernel {self.kernel_id} in time", code="timeout")
            try:
                data = await asyncio.wait_for(self.ws.read_message(), left)
            except asyncio.TimeoutError as e:
                raise Timeout(f"no message from kernel {self.kernel_id} in time", code="timeout") from e
            if data is None:  # closed
                await self._reconnect(deadline)
                continue
            m = wire.decode(self.protocol, data)
            if self.on_message is not None:
                self.on_message(m)
            return m

    async def execute(self, code: str, *, on_stdout=None, on_stderr=None, on_result=None, on_error=None,
                      on_output=None, on_input=None, timeout: float = 60.0) -> Execution:
        msg_id = await self.send("execute_request", wire.execute_content(code, on_input is not None))
        return await self.wait(msg_id, timeout, api.Callbacks(on_stdout, on_stderr, on_result, on_error, on_output),
                               on_input=on_input)

    async def wait(self, msg_id: str, timeout: float = 60.0, callbacks: Optional[api.Callbacks] = None,
                   on_input=None) -> Execution:
        col = wire.Collector(self.kernel_id, msg_id, callbacks, on_input)
        cb = col.cb
        deadline = time.monotonic() + timeout
        while not col.done:
            try:
                m = await self.recv(max(0.0, deadline - time.monotonic()))
            except Timeout:
                if col.interrupted:
                    break  # interrupted, and still no reply: give up waiting
                await self._interrupt()
                # Wait (briefly) for the interrupted cell to end, or ipykernel would
                # abort the next request as part of the failed cell's queue.
                col.interrupted, deadline = True, time.monotonic() + 10
                continue
            ask = col.feed(m)
            if cb.pending:
                pending, cb.pending = cb.pending, []
                await asyncio.gather(*pending)
            if ask is not None and on_input is not None:
                c = ask.get("content") or {}
                value = on_input(c.get("prompt", ""), bool(c.get("password")))
                if inspect.isawaitable(value):
                    value = await value
                await self.send("input_reply", {"value": value}, channel="stdin", parent=ask["header"])
        return col.finish(timeout)

    async def _interrupt(self) -> None:
        try:
            await AsyncHTTP(self.http_url, self.token, timeout=10).call(
                api.Call("POST", f"/api/kernels/{self.kernel_id}/interrupt", b"{}", (204,), lambda b: None))
        except SandgateError:
            pass

    def close(self) -> None:
        if self.ws is not None:
            self.ws.close()

    async def __aenter__(self) -> "AsyncKernelConnection":
        if self.ws is None:
            await self.connect()
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()
