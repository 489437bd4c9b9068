"""What the sync and async clients share: the requests of the sandbox API as data
(method, path, body, expected statuses, how to read the answer), the SSE parser and
the handling of a streamed execute. The transports (``_sync``, ``_async``) only move bytes."""

from __future__ import annotations

import inspect
import json
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional
from urllib.parse import quote

from .errors import BadRequest, SandboxDied, SandgateError, Timeout, error_from
from .models import Checkpoint, Execution, FileEntry, SandboxInfo

DEFAULT_URL = "http://127.0.0.1:8888"
DEFAULT_TIMEOUT = 60.0  # seconds, for a call that does not say
CREATE_TIMEOUT = 180.0  # a cold start of a microVM, or a restore, can take a while
RUN_GRACE = 30.0  # past a cell's timeout: the gateway interrupts it and answers; how long to wait for that
# An execute whose node went away (503 "unavailable", a dropped connection) is sent again with the same
# execution id, which the gateway runs at most once: this many more tries, waits doubling up to RETRY_MAX_WAIT.
# 8 tries wait 23.5 s in all: longer than a fleet takes to give up on a dead node (its heartbeat's 10 s TTL)
# and restore its sandbox elsewhere, so a kill -9 of the node is ridden out (4 tries, 7.5 s, would not be).
RETRIES = 8
RETRY_FIRST_WAIT, RETRY_MAX_WAIT = 0.5, 4.0


def settings(url: Optional[str], token: Optional[str]) -> tuple[str, str]:
    url = (url or os.environ.get("SANDGATE_URL") or DEFAULT_URL).rstrip("/")
    token = token if token is not None else os.environ.get("SANDGATE_TOKEN", "")
    return url, token


@dataclass
class Call:
    method: str
    path: str
    body: Optional[bytes] = None
    ok: tuple = (200,)
    parse: Callable[[bytes], Any] = lambda b: json.loads(b) if b else None
    timeout: Optional[float] = None
    headers: Dict[str, str] = field(default_factory=dict)
    kind: Optional[str] = None  # files: "file" or "directory", checked against the answer's Content-Type


def _json(body: Optional[dict]) -> bytes:
    return json.dumps(body if body is not None else {}).encode()


def _fpath(path: str) -> str:
    return quote(path.lstrip("/"), safe="/")


def create(*, driver=None, env=None, labels=None, limits=None, ttl=None, checkpoint=None, egress=None,
           secrets=None, timeout=None) -> Call:
    body: Dict[str, Any] = {}
    for k, v in (("driver", driver), ("env", env), ("labels", labels), ("limits", limits), ("ttl", ttl),
                 ("checkpoint", checkpoint), ("egress", egress), ("secrets", secrets)):
        if v is not None:
            body[k] = v
    return Call("POST", "/api/sandboxes", _json(body), (201,), lambda b: SandboxInfo.from_json(json.loads(b)),
                timeout or CREATE_TIMEOUT)


def get(sid: str, timeout=None) -> Call:
    return Call("GET", f"/api/sandboxes/{sid}", parse=lambda b: SandboxInfo.from_json(json.loads(b)), timeout=timeout)


def list_(timeout=None) -> Call:
    return Call("GET", "/api/sandboxes", parse=lambda b: [SandboxInfo.from_json(d) for d in json.loads(b)],
                timeout=timeout)


def tree(timeout=None) -> Call:
    """Every checkpoint and sandbox with their parent links (``{"nodes": [...]}``)."""
    return Call("GET", "/api/sandboxes/tree", timeout=timeout)


def delete(sid: str, timeout=None) -> Call:
    return Call("DELETE", f"/api/sandboxes/{sid}", ok=(204,), parse=lambda b: None, timeout=timeout)


def execute(sid: str, code: str, timeout: float, stream: bool, execution_id: Optional[str] = None,
            deadline: Optional[float] = None) -> Call:
    """``deadline`` (time.monotonic()): a retry gets what is left of the first try's time, no more."""
    headers = {"Accept": "text/event-stream"} if stream else {}
    body = {"code": code, "timeout": timeout, **({"id": execution_id} if execution_id else {})}
    left = timeout + RUN_GRACE if deadline is None else max(0.1, deadline - time.monotonic())
    return Call("POST", f"/api/sandboxes/{sid}/execute", _json(body),
                parse=lambda b: Execution.from_json(json.loads(b)), timeout=left, headers=headers)


def new_execution_id() -> str:
    return uuid.uuid4().hex


def retry_wait(e: SandgateError, attempt: int, deadline: float) -> Optional[float]:
    """How long to wait before trying an execute again after ``e``; None: do not (not a lost
    node or connection, out of tries, or no time left for another)."""
    lost = getattr(e, "code", None) in ("unavailable", "unreachable") or getattr(e, "incomplete", False)
    if not lost or attempt >= RETRIES:
        return None
    wait = min(RETRY_FIRST_WAIT * 2 ** attempt, RETRY_MAX_WAIT)
    return wait if time.monotonic() + wait < deadline else None


def pause(sid: str, mode: str, timeout=None) -> Call:
    return Call("POST", f"/api/sandboxes/{sid}/pause", _json({"mode": mode}),
                parse=lambda b: SandboxInfo.from_json(json.loads(b)), timeout=timeout or CREATE_TIMEOUT)


def resume(sid: str, timeout=None) -> Call:
    return Call("POST", f"/api/sandboxes/{sid}/resume", _json({}),
                parse=lambda b: SandboxInfo.from_json(json.loads(b)), timeout=timeout or CREATE_TIMEOUT)


def checkpoint(sid: str, name: str = "", timeout=None) -> Call:
    return Call("POST", f"/api/sandboxes/{sid}/checkpoints", _json({"name": name}), (201,),
                lambda b: Checkpoint.from_json(json.loads(b)), timeout or CREATE_TIMEOUT)


def checkpoints(sid: str, timeout=None) -> Call:
    return Call("GET", f"/api/sandboxes/{sid}/checkpoints",
                parse=lambda b: [Checkpoint.from_json(d) for d in json.loads(b)], timeout=timeout)


def delete_checkpoint(sid: str, checkpoint_id: str, timeout=None) -> Call:
    return Call("DELETE", f"/api/sandboxes/{sid}/checkpoints/{checkpoint_id}", ok=(204,), parse=lambda b: None,
                timeout=timeout)


def fork(sid: str, checkpoint_id: Optional[str] = None, timeout=None) -> Call:
    body = {"checkpoint": checkpoint_id} if checkpoint_id else {}
    return Call("POST", f"/api/sandboxes/{sid}/fork", _json(body), (201,),
                lambda b: SandboxInfo.from_json(json.loads(b)), timeout or CREATE_TIMEOUT)


def set_egress(sid: str, policy: dict, timeout=None) -> Call:
    return Call("PATCH", f"/api/sandboxes/{sid}/egress", _json(policy),
                parse=lambda b: SandboxInfo.from_json(json.loads(b)), timeout=timeout)


def write_file(sid: str, path: str, data: bytes | str, timeout=None) -> Call:
    if isinstance(data, str):
        data = data.encode()
    return Call("PUT", f"/api/sandboxes/{sid}/files/{_fpath(path)}", bytes(data), (201,), timeout=timeout,
                headers={"Content-Type": "application/octet-stream"})


def read_file(sid: str, path: str, timeout=None) -> Call:
    def parse(b: bytes) -> bytes:
        return b
    return Call("GET", f"/api/sandboxes/{sid}/files/{_fpath(path)}", parse=parse, timeout=timeout, kind="file")


def list_files(sid: str, path: str = "", timeout=None) -> Call:
    base = path.strip("/")

    def parse(b: bytes) -> List[FileEntry]:
        d = json.loads(b)
        return [FileEntry(e["name"], e.get("type", "file"), e.get("size", 0), e.get("mtime", 0.0),
                          f"{base}/{e['name']}" if base else e["name"]) for e in d.get("entries", [])]
    return Call("GET", f"/api/sandboxes/{sid}/files/{_fpath(path)}", parse=parse, timeout=timeout,
                kind="directory")


def remove_file(sid: str, path: str, timeout=None) -> Call:
    return Call("DELETE", f"/api/sandboxes/{sid}/files/{_fpath(path)}", ok=(204,), parse=lambda b: None,
                timeout=timeout)


def check_kind(call: Call, content_type: str) -> None:
    """The files route answers a directory with a JSON listing and a file with its bytes."""
    if call.kind is None:
        return
    is_dir = "json" in (content_type or "")
    if call.kind == "file" and is_dir:
        raise BadRequest(f"{call.path.split('/files/', 1)[-1] or '/'} is a directory", status=400,
                         code="IsADirectoryError")
    if call.kind == "directory" and not is_dir:
        raise BadRequest(f"{call.path.split('/files/', 1)[-1]} is not a directory", status=400,
                         code="NotADirectoryError")


class SSEParser:
    """Server-sent events, fed bytes as they come: yields (event, data) pairs."""

    def __init__(self):
        self.buf = b""
        self.event, self.data = "message", []

    def feed(self, chunk: bytes) -> list:
        self.buf += chunk
        events = []
        while b"\n" in self.buf:
            line, self.buf = self.buf.split(b"\n", 1)
            line = line.rstrip(b"\r").decode("utf-8", "replace")
            if not line:
                if self.data:
                    events.append((self.event, "\n".join(self.data)))
                self.event, self.data = "message", []
            elif line.startswith(":"):
                continue
            else:
                name, _, value = line.partition(":")
                value = value[1:] if value.startswith(" ") else value
                if name == "event":
                    self.event = value
                elif name == "data":
                    self.data.append(value)
        return events


class Callbacks:
    """The streaming callbacks of run_code: each gets its piece as it happens.
    on_stdout/on_stderr get text, on_result a Result, on_error an ExecutionError,
    on_output every raw output dict. A coroutine function's result is awaited (async client)."""

    def __init__(self, on_stdout=None, on_stderr=None, on_result=None, on_error=None, on_output=None):
        self.on_stdout, self.on_stderr, self.on_result = on_stdout, on_stderr, on_result
        self.on_error, self.on_output = on_error, on_output
        self.live = Execution()
        self.pending: list = []  # awaitables the async client awaits
        # A retry that joins the execution gets its outputs from the start again: the ones
        # already delivered are skipped (index counts this try's, high the most ever delivered).
        self.index = self.high = 0
        self.reran = False

    def rewind(self) -> None:
        self.index = 0

    def begin(self, run: str) -> None:
        """The gateway says how it serves this try. "new" after outputs were delivered: the run
        that made them died with its node, and the cell runs again from the sandbox's checkpoint.
        Its outputs are all passed on, from its start; the result is that run's alone."""
        if run == "new" and self.high:
            self.high, self.live, self.reran = 0, Execution(), True

    def _call(self, fn, arg) -> None:
        if fn is None:
            return
        r = fn(arg)
        if inspect.isawaitable(r):
            self.pending.append(r)

    def output(self, out: dict) -> None:
        self.index += 1
        if self.index <= self.high:
            return
        self.high = self.index
        before = len(self.live.results)
        self.live.add(out)
        self._call(self.on_output, out)
        kind = out.get("type")
        if kind == "stream":
            self._call(self.on_stderr if out.get("name") == "stderr" else self.on_stdout, out.get("text") or "")
        elif kind in ("execute_result", "display_data") and len(self.live.results) > before:
            self._call(self.on_result, self.live.results[-1])
        elif kind == "error":
            self._call(self.on_error, self.live.error)

    def ended(self, ex: Execution) -> None:
        """An error only the kernel's reply carried (Aborted, DeadKernelError) reaches on_error too."""
        if ex.error is not None and not any(o.get("type") == "error" for o in ex.outputs):
            self._call(self.on_error, ex.error)


def finish(ex: Execution, timeout: float) -> Execution:
    """Turn what the cell ended as into an exception where the SDK promises one."""
    if ex.status == "timeout":
        err = Timeout(f"the cell ran past its timeout of {timeout:g} s and was interrupted", code="timeout")
        err.execution = ex
        raise err
    if ex.error is not None and ex.error.ename == "DeadKernelError":
        err = SandboxDied(f"the sandbox died while running the cell: {ex.error.evalue}", code="conflict",
                          state="dead")
        err.execution = ex
        raise err
    return ex


def stream_event(cb: Callbacks, event: str, data: str) -> Optional[Execution]:
    """One SSE event of a streamed execute; the Execution once it has ended."""
    d = json.loads(data)
    if event == "output":
        cb.output(d)
        return None
    if event == "execution":
        cb.begin(d.get("run", ""))
        return None
    if event == "result":
        ex = Execution.from_json(d)
        ex.reran = cb.reran
        cb.ended(ex)
        return ex
    if event == "error":
        raise error_from(None, d)
    return None


def incomplete() -> SandgateError:
    e = SandgateError("the gateway closed the execute stream before its result")
    e.incomplete = True  # a dropped connection: retried with the same execution id
    return e
