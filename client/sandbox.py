"""The synchronous client: ``Sandbox`` over the gateway's sandbox API (http.client,
no dependency), ``KernelConnection`` over the kernel websocket (``kernel()``)."""

from __future__ import annotations

import http.client
import socket
import ssl
import time
from typing import TYPE_CHECKING, Any, Callable, List, Optional
from urllib.parse import urlsplit

from . import _api as api
from .errors import Conflict, SandboxDied, SandgateError, Timeout, Unavailable, error_from
from .models import Checkpoint, Execution, FileEntry, SandboxInfo

if TYPE_CHECKING:
    from .kernel import KernelConnection


class HTTP:
    """One gateway: its URL and token. Each call has a timeout (never a hang):
    connect and every read are bounded by what is left of it."""

    def __init__(self, url: Optional[str] = None, token: Optional[str] = None, timeout: float = api.DEFAULT_TIMEOUT):
        self.url, self.token = api.settings(url, token)
        self.timeout = timeout
        u = urlsplit(self.url)
        self.scheme, self.host, self.port = u.scheme or "http", u.hostname or "127.0.0.1", u.port
        self.prefix = u.path.rstrip("/")

    def _open(self, call: api.Call, timeout: float):
        cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        conn = cls(self.host, self.port, timeout=timeout)
        headers = {"Content-Type": "application/json", **call.headers}
        if self.token:
            headers["Authorization"] = f"token {self.token}"
        try:
            conn.request(call.method, self.prefix + call.path, body=call.body, headers=headers)
            return conn, conn.getresponse()
        except (socket.timeout, TimeoutError) as e:
            conn.close()
            raise Timeout(f"{call.method} {call.path}: no answer in {timeout:g} s", code="timeout") from e
        except (ConnectionError, OSError, ssl.SSLError, http.client.HTTPException) as e:
            conn.close()
            raise Unavailable(f"cannot reach the gateway at {self.url}: {e}", code="unreachable") from e

    def call(self, call: api.Call) -> Any:
        timeout = call.timeout or self.timeout
        conn, resp = self._open(call, timeout)
        try:
            body = resp.read()
        except (socket.timeout, TimeoutError) as e:
            raise Timeout(f"{call.method} {call.path}: no answer in {timeout:g} s", code="timeout") from e
        except (OSError, http.client.HTTPException) as e:
            raise Unavailable(f"the gateway at {self.url} dropped the connection: {e}", code="unreachable") from e
        finally:
            conn.close()
        if resp.status not in call.ok:
            raise error_from(resp.status, body, resp.headers)
        api.check_kind(call, resp.headers.get("Content-Type", ""))
        return call.parse(body)

    def stream(self, call: api.Call, cb: api.Callbacks) -> Execution:
        """A streamed execute: SSE events until ``result`` (or ``error``)."""
        timeout = call.timeout or self.timeout
        deadline = time.monotonic() + timeout
        conn, resp = self._open(call, timeout)
        try:
            if resp.status != 200:
                raise error_from(resp.status, resp.read(), resp.headers)
            parser = api.SSEParser()
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise socket.timeout()
                conn.sock.settimeout(left)
                chunk = resp.read1(65536)
                if not chunk:
                    raise api.incomplete()
                for event, data in parser.feed(chunk):
                    done = api.stream_event(cb, event, data)
                    if done is not None:
                        return done
        except (socket.timeout, TimeoutError) as e:
            raise Timeout(f"{call.path}: no result in {timeout:g} s", code="timeout") from e
        except (OSError, http.client.HTTPException) as e:
            raise Unavailable(f"the gateway at {self.url} dropped the execute stream: {e}", code="unreachable") from e
        finally:
            conn.close()


class Files:
    """``sb.files``: the sandbox's workspace (paths relative to it)."""

    def __init__(self, sb: "Sandbox"):
        self._sb = sb

    def write(self, path: str, data: bytes | str, timeout: Optional[float] = None) -> dict:
        return self._sb._http.call(api.write_file(self._sb.id, path, data, timeout))

    def read(self, path: str, timeout: Optional[float] = None) -> bytes:
        return self._sb._http.call(api.read_file(self._sb.id, path, timeout))

    def read_text(self, path: str, encoding: str = "utf-8", timeout: Optional[float] = None) -> str:
        return self.read(path, timeout).decode(encoding)

    def list(self, path: str = "", timeout: Optional[float] = None) -> List[FileEntry]:
        return self._sb._http.call(api.list_files(self._sb.id, path, timeout))

    def remove(self, path: str, timeout: Optional[float] = None) -> None:
        self._sb._http.call(api.remove_file(self._sb.id, path, timeout))

    def exists(self, path: str, timeout: Optional[float] = None) -> bool:
        from .errors import NotFound
        parent, _, name = path.strip("/").rpartition("/")
        try:
            return any(e.name == name for e in self.list(parent, timeout))
        except NotFound:
            return False


class Sandbox:
    """A sandbox on a Sandgate gateway.

    ``with Sandbox.create() as sb: sb.run_code("1+1").text`` -- the sandbox is
    deleted when the block ends. ``url``/``token`` default to ``SANDGATE_URL`` /
    ``SANDGATE_TOKEN``."""

    def __init__(self, info: SandboxInfo, http_: HTTP):
        self._http = http_
        self.info = info
        self.id = info.id
        self.files = Files(self)

    # -- making and finding sandboxes --------------------------------------------
    @classmethod
    def create(cls, url: Optional[str] = None, token: Optional[str] = None, *, driver: Optional[str] = None,
               env: Optional[dict] = None, labels: Optional[dict] = None, limits: Optional[dict] = None,
               ttl: Optional[float] = None, checkpoint: Optional[str] = None, egress: Optional[dict] = None,
               secrets: Optional[list] = None, timeout: Optional[float] = None) -> "Sandbox":
        """Start a sandbox (cold, or from ``checkpoint``) and return once it runs.
        ``egress={"allow": [...], "deny": [...]}``; ``secrets=[{"host", "header"?, "value", "name"?}]``."""
        h = HTTP(url, token)
        info = h.call(api.create(driver=driver, env=env, labels=labels, limits=limits, ttl=ttl,
                                 checkpoint=checkpoint, egress=egress, secrets=secrets, timeout=timeout))
        return cls(info, h)

    @classmethod
    def restore(cls, checkpoint: str, url: Optional[str] = None, token: Optional[str] = None, **kw) -> "Sandbox":
        """A new sandbox started from a checkpoint (of any sandbox this token can see)."""
        return cls.create(url, token, checkpoint=checkpoint, **kw)

    @classmethod
    def connect(cls, sandbox_id: str, url: Optional[str] = None, token: Optional[str] = None,
                timeout: Optional[float] = None) -> "Sandbox":
        h = HTTP(url, token)
        return cls(h.call(api.get(sandbox_id, timeout)), h)

    @classmethod
    def list(cls, url: Optional[str] = None, token: Optional[str] = None,
             timeout: Optional[float] = None) -> List[SandboxInfo]:
        return HTTP(url, token).call(api.list_(timeout))

    # -- this sandbox -------------------------------------------------------------
    def refresh(self, timeout: Optional[float] = None) -> SandboxInfo:
        self.info = self._http.call(api.get(self.id, timeout))
        return self.info

    @property
    def state(self) -> str:
        return self.info.state

    def run_code(self, code: str, *, on_stdout: Optional[Callable[[str], Any]] = None,
                 on_stderr: Optional[Callable[[str], Any]] = None, on_result: Optional[Callable] = None,
                 on_error: Optional[Callable] = None, on_output: Optional[Callable[[dict], Any]] = None,
                 timeout: float = 60.0) -> Execution:
        """Run one cell. Output streams to the callbacks as it happens (the sandbox
        API's SSE execute); the return value has it all. An exception in the code is
        ``result.error`` (not raised). Past ``timeout`` the gateway interrupts the cell
        and ``Timeout`` is raised (``e.execution`` has the output so far); a sandbox
        that dies mid-cell raises ``SandboxDied``."""
        cb = api.Callbacks(on_stdout, on_stderr, on_result, on_error, on_output)
        # One id for every try: a retry after a lost node joins the run or gets its result, never reruns it.
        eid, deadline, attempt = api.new_execution_id(), time.monotonic() + timeout + api.RUN_GRACE, 0
        while True:
            try:
                ex = self._http.stream(api.execute(self.id, code, timeout, True, eid, deadline), cb)
                break
            except Conflict as e:
                raise self._died(e, cb.live)
            except SandgateError as e:
                wait = api.retry_wait(e, attempt, deadline)
                if wait is None:
                    raise
                attempt += 1
                cb.rewind()
                time.sleep(wait)
        return api.finish(ex, timeout)

    def _died(self, e: Conflict, live: Execution) -> Conflict:
        """A conflict that came as an SSE event has no ``state``: ask for it."""
        if isinstance(e, SandboxDied) or e.state is not None:
            return e
        try:
            state = self.refresh(10).state
        except SandgateError:
            return e
        if state != "dead":
            return e
        died = SandboxDied(e.message, status=409, code=e.code, reason=e.reason, state="dead", body=e.body)
        died.execution = live
        return died

    def checkpoint(self, name: str = "", timeout: Optional[float] = None) -> Checkpoint:
        return self._http.call(api.checkpoint(self.id, name, timeout))

    def checkpoints(self, timeout: Optional[float] = None) -> List[Checkpoint]:
        return self._http.call(api.checkpoints(self.id, timeout))

    def delete_checkpoint(self, checkpoint: str, timeout: Optional[float] = None) -> None:
        """Delete one of its checkpoints (and what only it stored). ``Conflict`` (code ``in_use``)
        names what still needs it: a fork from it, its newest, a sandbox resuming from it."""
        self._http.call(api.delete_checkpoint(self.id, checkpoint, timeout))

    def fork(self, checkpoint: Optional[str] = None, timeout: Optional[float] = None) -> "Sandbox":
        """A new sandbox from this one: from ``checkpoint`` (one of its own), or from now."""
        return Sandbox(self._http.call(api.fork(self.id, checkpoint, timeout)), self._http)

    def pause(self, mode: str = "disk", timeout: Optional[float] = None) -> SandboxInfo:
        """``disk``: checkpoint and stop (memory freed); ``memory``: frozen in place."""
        self.info = self._http.call(api.pause(self.id, mode, timeout))
        return self.info

    def resume(self, timeout: Optional[float] = None) -> SandboxInfo:
        self.info = self._http.call(api.resume(self.id, timeout))
        return self.info

    def set_egress(self, allow: Optional[list] = None, deny: Optional[list] = None,
                   timeout: Optional[float] = None) -> SandboxInfo:
        self.info = self._http.call(api.set_egress(self.id, {"allow": allow or [], "deny": deny or []}, timeout))
        return self.info

    def kernel(self, timeout: float = 30.0, **options) -> "KernelConnection":
        """The Jupyter websocket of this sandbox's kernel (reconnects with replay); ``options``:
        ``session``, ``protocol``, ``on_message``, ``max_reconnects`` (``KernelConnection``)."""
        from .kernel import KernelConnection
        return KernelConnection(self._http.url, self._http.token, self.id, timeout=timeout, **options)

    def delete(self, timeout: Optional[float] = None) -> None:
        self._http.call(api.delete(self.id, timeout))

    kill = delete

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, exc_type, *_) -> None:
        from .errors import NotFound
        try:
            self.delete()
        except NotFound:
            pass  # already gone
        except SandgateError:
            if exc_type is None:
                raise  # otherwise the block's own exception is the one to see

    def __repr__(self) -> str:
        return f"<Sandbox {self.id} {self.info.state}>"
