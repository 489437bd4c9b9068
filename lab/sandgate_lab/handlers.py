"""The Lab server's side of the sandbox panel and the workspace drive: a few routes under
``{base_url}sandgate/api/kernels/{id}/`` that call the gateway's sandbox API with the Lab
server's GatewayClient settings, so the gateway's token stays in this process.

Only this Lab server's kernels are reachable (those its kernel manager started or attached),
as its own ``/api/kernels`` lists them: the gateway token may be the admin's, and a page of
this Lab must not reach the other kernels on that gateway. Errors keep the gateway's status
and JSON body (``message``, ``code``), which the panel shows as they are.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Optional
from urllib.parse import quote

from jupyter_server.base.handlers import APIHandler
from jupyter_server.gateway.gateway_client import GatewayClient
from jupyter_server.utils import url_path_join
from tornado import httpclient, web
from tornado.httputil import HTTPHeaders, parse_response_start_line

KID = r"(?P<kid>[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})"
# Uploads and downloads stream through this server a chunk at a time; a large file on a
# busy gateway takes longer than the GatewayClient's request_timeout meant for kernel starts.
FILE_TIMEOUT = 3600.0
# What one PUT may carry through here: the gateway's own bound (SANDGATE_MAX_MESSAGE_MB,
# 64 MiB by default) answers a larger file with its 413 and message.
MAX_UPLOAD = 1 << 30


class GatewayError(web.HTTPError):
    """An error with a JSON body to send as it is (the gateway's, or ours in its shape)."""

    def __init__(self, status: int, body: dict):
        super().__init__(status, body.get("message"))
        self.body = body


def _gateway() -> GatewayClient:
    gc = GatewayClient.instance()
    if not gc.gateway_enabled:
        raise GatewayError(409, {"reason": "Conflict", "code": "no_gateway",
                                 "message": "this Lab server runs its kernels itself (no --gateway-url): "
                                            "they have no Sandgate sandbox"})
    return gc


def _request(method: str, path: str, body=None, timeout: Optional[float] = None, **kw) -> httpclient.HTTPRequest:
    gc = _gateway()
    args = gc.load_connection_args(headers={})
    if timeout:
        args["request_timeout"] = max(float(args.get("request_timeout") or 0), timeout)
    args.update(kw)
    return httpclient.HTTPRequest(url_path_join(gc.url, path), method=method, body=body, **args)


def _error_from(resp_code: int, body: bytes, error: Optional[BaseException], url: str) -> GatewayError:
    if resp_code == 599 or not body:
        why = str(error) if error else f"HTTP {resp_code}"
        status = 502 if resp_code == 599 else resp_code
        return GatewayError(status, {"reason": "Bad Gateway", "code": "gateway_unreachable" if status == 502 else "",
                                     "message": f"the gateway did not answer {url}: {why}"})
    try:
        data = json.loads(body)
        if not isinstance(data, dict):
            raise ValueError
    except ValueError:
        data = {"message": body.decode("utf-8", "replace")[:2000]}
    return GatewayError(resp_code, data)


class SandgateHandler(APIHandler):
    """Auth, XSRF and the kernel check are jupyter_server's (APIHandler); errors are JSON."""

    def check_kernel(self, kid: str) -> None:
        _gateway()
        if kid not in self.kernel_manager:
            raise GatewayError(404, {"reason": "Not Found", "code": "not_found",
                                     "message": f"Kernel {kid} is not one of this Lab server's kernels "
                                                f"(deleted, or never started or attached here)"})

    async def call(self, method: str, path: str, payload: Optional[dict] = None):
        body = json.dumps(payload or {}).encode() if method in ("POST", "PUT", "PATCH") else None
        req = _request(method, path, body)
        req.headers["Content-Type"] = "application/json"
        resp = await httpclient.AsyncHTTPClient().fetch(req, raise_error=False)
        if resp.code >= 400 or resp.code == 599:
            raise _error_from(resp.code, resp.body, resp.error, req.url)
        return json.loads(resp.body) if resp.body else None

    def write_error(self, status_code, **kwargs):
        exc = kwargs.get("exc_info", (None, None, None))[1]
        if isinstance(exc, GatewayError):
            self.set_header("Content-Type", "application/json")
            self.finish(json.dumps(exc.body))
        else:
            super().write_error(status_code, **kwargs)

    def send(self, data, status: int = 200) -> None:
        self.set_status(status)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(data))


class SandboxHandler(SandgateHandler):
    @web.authenticated
    async def get(self, kid):
        self.check_kernel(kid)
        self.send(await self.call("GET", f"/api/sandboxes/{kid}"))


class CheckpointsHandler(SandgateHandler):
    @web.authenticated
    async def get(self, kid):
        self.check_kernel(kid)
        self.send(await self.call("GET", f"/api/sandboxes/{kid}/checkpoints"))

    @web.authenticated
    async def post(self, kid):
        self.check_kernel(kid)
        name = (self.get_json_body() or {}).get("name") or None
        self.send(await self.call("POST", f"/api/sandboxes/{kid}/checkpoints", {"name": name} if name else {}), 201)


class TreeHandler(SandgateHandler):
    """This kernel's checkpoints, and the sandboxes forked or started from them: the part of the
    gateway's tree the panel draws (the rest may be other people's kernels on the gateway)."""

    @web.authenticated
    async def get(self, kid):
        self.check_kernel(kid)
        nodes = (await self.call("GET", "/api/sandboxes/tree"))["nodes"]
        mine = [n for n in nodes if n.get("kind") == "checkpoint" and n.get("sandbox") == kid]
        ids = {c["id"] for c in mine}
        forks = [n for n in nodes if n.get("kind") == "sandbox" and n.get("parent") in ids]
        self.send({"checkpoints": mine, "forks": forks})


class ForkHandler(SandgateHandler):
    @web.authenticated
    async def post(self, kid):
        self.check_kernel(kid)
        cp = (self.get_json_body() or {}).get("checkpoint") or None
        fork = await self.call("POST", f"/api/sandboxes/{kid}/fork", {"checkpoint": cp} if cp else {})
        # The fork is a new kernel on the gateway that this Lab server did not start: its kernel
        # manager attaches it, so that a session (the copied notebook) can use it by id and it is
        # listed, and shut down with Lab, like the Lab's other kernels.
        await self.kernel_manager.start_kernel(kernel_id=fork["id"])
        self.send(fork, 201)


class PauseHandler(SandgateHandler):
    @web.authenticated
    async def post(self, kid):
        self.check_kernel(kid)
        mode = (self.get_json_body() or {}).get("mode") or "disk"
        self.send(await self.call("POST", f"/api/sandboxes/{kid}/pause", {"mode": mode}))


class ResumeHandler(SandgateHandler):
    @web.authenticated
    async def post(self, kid):
        self.check_kernel(kid)
        self.send(await self.call("POST", f"/api/sandboxes/{kid}/resume", {}))


def _files_path(kid: str, path: str) -> str:
    return f"/api/sandboxes/{kid}/files/{quote(path, safe='/')}"


@web.stream_request_body
class FilesHandler(SandgateHandler):
    """The workspace's files. GET passes the gateway's answer on a chunk at a time (a listing
    for a directory, with ``X-Sandgate-Kind: directory``); PUT spools the body to a temporary
    file as it arrives and then streams it to the gateway, so neither a download nor an upload
    is held whole in this server's memory. ``?chunk=N`` (1, 2, ..., -1 for the last) is Lab's
    chunked upload of a large file: the chunks are appended to one spool file and the last
    sends it."""

    _spools: dict = {}  # (kid, path) -> spool file of a chunked upload in progress

    async def prepare(self):
        await super().prepare()
        self._spool = None
        if self.request.method != "PUT" or self._finished:
            return
        # Refused before a byte of the body is spooled: no login, or not this Lab's kernel.
        if not self.current_user:
            raise web.HTTPError(403)
        kid, path = self.path_kwargs["kid"], self.path_kwargs["path"] or ""
        self.check_kernel(kid)
        self.request.connection.set_max_body_size(MAX_UPLOAD)
        chunk = self.get_query_argument("chunk", None)
        key = (kid, path)
        if chunk in (None, "1"):
            old = self._spools.pop(key, None)
            if old:
                old.close()
            self._spool = tempfile.TemporaryFile(prefix="sandgate-upload-")
        elif key in self._spools:
            self._spool = self._spools[key]
        else:
            raise GatewayError(409, {"reason": "Conflict", "code": "conflict",
                                     "message": f"chunk {chunk} of {path} came without the chunks before it"})

    def data_received(self, chunk: bytes) -> None:
        if self._spool is not None:
            self._spool.write(chunk)

    def on_connection_close(self):
        # A client gone mid-upload: its spool goes (a chunked one stays for its next chunk).
        if self._spool is not None and self._spool not in self._spools.values():
            self._spool.close()

    @web.authenticated
    async def get(self, kid, path=None):
        path = path or ""
        self.check_kernel(kid)
        if self.get_query_argument("unless_paused", None):
            # A file browser's poll: any files call resumes a paused sandbox, which a listing
            # nobody asked for must not do. Checked here, next to the gateway, to keep the
            # window between the check and the call small.
            sb = await self.call("GET", f"/api/sandboxes/{kid}")
            if sb["state"] in ("pausing", "paused", "frozen"):
                raise GatewayError(409, {"reason": "Conflict", "code": "paused", "state": sb["state"],
                                         "message": f"sandbox {kid} is {sb['state']}; not resumed to list its files"})
        state = {"code": 0, "headers": HTTPHeaders(), "error": b"", "started": False}

        def on_header(line: str) -> None:
            if line.startswith("HTTP/"):
                state["code"] = parse_response_start_line(line.strip()).code
                state["headers"] = HTTPHeaders()
            elif line.strip():
                state["headers"].parse_line(line.rstrip("\r\n"))

        def on_chunk(data: bytes) -> None:
            if state["code"] >= 400:
                state["error"] += data[:65536 - len(state["error"])]
                return
            if not state["started"]:
                state["started"] = True
                self._start_download(state["headers"], path)
            self.write(data)
            self.flush()

        req = _request("GET", _files_path(kid, path), timeout=FILE_TIMEOUT,
                       header_callback=on_header, streaming_callback=on_chunk)
        resp = await httpclient.AsyncHTTPClient().fetch(req, raise_error=False)
        if resp.code >= 400 or resp.code == 599:
            if state["started"]:  # cut short after the headers went out: the client sees a short body
                raise web.HTTPError(502)
            raise _error_from(resp.code, state["error"], resp.error, req.url)
        if not state["started"]:  # an empty file
            self._start_download(state["headers"], path)
        self.finish()

    def _start_download(self, headers: HTTPHeaders, path: str) -> None:
        kind = "directory" if headers.get("Content-Type", "").startswith("application/json") else "file"
        self.set_header("X-Sandgate-Kind", kind)
        self.set_header("Content-Type", "application/json" if kind == "directory" else "application/octet-stream")
        if headers.get("Content-Length"):
            self.set_header("Content-Length", headers["Content-Length"])
        if kind == "file" and self.get_query_argument("download", None):
            name = os.path.basename(path) or "download"
            self.set_header("Content-Disposition", f"attachment; filename*=UTF-8''{quote(name)}")

    @web.authenticated
    async def put(self, kid, path=None):
        path = path or ""
        self.check_kernel(kid)
        chunk = self.get_query_argument("chunk", None)
        spool, key = self._spool, (kid, path)
        if chunk not in (None, "-1"):  # more chunks to come
            self._spools[key] = spool
            return self.send({"path": path, "size": spool.tell()}, 201)
        self._spools.pop(key, None)
        try:
            size = spool.tell()
            spool.seek(0)

            async def produce(write):
                while True:
                    data = spool.read(1 << 20)
                    if not data:
                        return
                    await write(data)

            req = _request("PUT", _files_path(kid, path), timeout=FILE_TIMEOUT, body_producer=produce,
                           allow_nonstandard_methods=True)
            req.headers["Content-Length"] = str(size)
            req.headers["Content-Type"] = "application/octet-stream"
            resp = await httpclient.AsyncHTTPClient().fetch(req, raise_error=False)
            if resp.code >= 400 or resp.code == 599:
                raise _error_from(resp.code, resp.body, resp.error, req.url)
            self.send(json.loads(resp.body), 201)
        finally:
            spool.close()

    @web.authenticated
    async def delete(self, kid, path=None):
        path = path or ""
        self.check_kernel(kid)
        req = _request("DELETE", _files_path(kid, path))
        resp = await httpclient.AsyncHTTPClient().fetch(req, raise_error=False)
        if resp.code >= 400 or resp.code == 599:
            raise _error_from(resp.code, resp.body, resp.error, req.url)
        self.set_status(204)
        self.finish()


def setup_handlers(server_app) -> None:
    web_app = server_app.web_app
    base = url_path_join(web_app.settings.get("base_url", "/"), "sandgate", "api", "kernels", KID)
    web_app.add_handlers(".*$", [
        (base, SandboxHandler),
        (url_path_join(base, "checkpoints"), CheckpointsHandler),
        (url_path_join(base, "tree"), TreeHandler),
        (url_path_join(base, "fork"), ForkHandler),
        (url_path_join(base, "pause"), PauseHandler),
        (url_path_join(base, "resume"), ResumeHandler),
        (url_path_join(base, "files") + r"(?:/(?P<path>.*))?", FilesHandler),
    ])
