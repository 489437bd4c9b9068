"""Fixtures that run the real thing: a `sandgate serve` process whose kernels
are runsc sandboxes built from the real image, driven by real clients."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest
import websocket

from sandgate.config import default_home
from sandgate_images import rootfs as images

HOME = Path(os.environ.get("SANDGATE_HOME") or default_home())


@pytest.fixture(scope="session")
def home() -> Path:
    """The image cache, built once (about 2 minutes on a fresh machine)."""
    images.build(HOME)
    return HOME


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Response:
    def __init__(self, status, headers, body):
        self.status, self.headers, self.body = status, headers, body

    def json(self):
        return json.loads(self.body)


class Gateway:
    """A running `sandgate serve` and a small HTTP client for it."""

    def __init__(self, home: Path, tmp: Path, token="test-token", env=None, args=(), own_home=None):
        self.port = free_port()
        self.token = token
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / f"gateway-{self.port}.log"
        # A home of its own (a gateway reclaims its home's sandboxes at start),
        # sharing the built image.
        self.home = own_home or tmp / f"home-{self.port}"
        if own_home is None:
            self.home.mkdir()
            (self.home / "images").symlink_to(home / "images")
        # Kept sandboxes are paused to disk at every stop: only the restart tests want that.
        full_env = {**os.environ, "SANDGATE_HOME": str(self.home), "SANDGATE_TOKEN": token,
                    "SANDGATE_KEEP_SANDBOXES": "false", **(env or {})}
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "sandgate.cli", "serve", "--port", str(self.port), *args],
                                     env=full_env, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited: {self.log_text()}")
            try:
                if self.request("GET", "/api").status == 200:
                    return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"gateway did not come up: {self.log_text()}")

    def log_text(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text()

    def request(self, method, path, body=None, token=None, headers=None, raw=None, timeout=180) -> Response:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        h = {"Content-Type": "application/json", **(headers or {})}
        tok = self.token if token is None else token
        if tok:
            h["Authorization"] = f"token {tok}"
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=h)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return Response(r.status, r.headers, r.read())
        except urllib.error.HTTPError as e:
            return Response(e.code, e.headers, e.read())

    def start_kernel(self, name="python3", env=None) -> str:
        r = self.request("POST", "/api/kernels", {"name": name, **({"env": env} if env else {})})
        assert r.status == 201, r.body
        return r.json()["id"]

    def connect(self, kernel_id, v1=False, session=None) -> "KernelClient":
        return KernelClient(self, kernel_id, v1=v1, session=session)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


class KernelClient:
    """A plain websocket client speaking Jupyter messages, legacy or v1."""

    def __init__(self, gw: Gateway, kernel_id: str, v1=False, session=None):
        from sandgate.api import wire

        self.wire = wire
        self.v1 = v1
        self.seen = []  # every message received, in order
        self.session = session or uuid.uuid4().hex
        url = f"ws://127.0.0.1:{gw.port}/api/kernels/{kernel_id}/channels?session_id={self.session}"
        self.ws = websocket.create_connection(url, header=[f"Authorization: token {gw.token}"],
                                              subprotocols=[wire.V1] if v1 else None, timeout=120)

    def send(self, msg_type, content, channel="shell", parent=None) -> str:
        header = {"msg_id": uuid.uuid4().hex, "msg_type": msg_type, "session": self.session, "username": "test",
                  "date": "2026-01-01T00:00:00.000000Z", "version": "5.3"}
        if self.v1:
            parts = [json.dumps(x).encode() for x in (header, parent or {}, {}, content)]
            self.ws.send_binary(self.wire.encode_v1(channel, parts))
        else:
            self.ws.send(json.dumps({"header": header, "parent_header": parent or {}, "metadata": {},
                                     "content": content, "channel": channel}))
        return header["msg_id"]

    def _recv(self, timeout) -> dict:
        self.ws.settimeout(timeout)
        opcode, data = self.ws.recv_data()
        if self.v1:
            assert opcode == websocket.ABNF.OPCODE_BINARY
            n = int.from_bytes(data[:8], "little")
            offs = [int.from_bytes(data[8 * (i + 1):8 * (i + 2)], "little") for i in range(n)]
            channel = data[offs[0]:offs[1]].decode()
            parts = [data[offs[i]:offs[i + 1]] for i in range(1, n - 1)]
            header, parent, meta, content = (json.loads(p) for p in parts[:4])
            return {"channel": channel, "header": header, "msg_type": header["msg_type"], "parent_header": parent,
                    "metadata": meta, "content": content, "buffers": parts[4:]}
        return json.loads(data)

    def recv(self, timeout=120) -> dict:
        m = self._recv(timeout)
        self.seen.append(m)
        return m

    def execute(self, code, timeout=120, stdin_reply=None, allow_stdin=False) -> dict:
        """Run a cell; collect its iopub output and reply until it is idle."""
        mid = self.send("execute_request", {"code": code, "silent": False, "store_history": True,
                                            "user_expressions": {}, "allow_stdin": allow_stdin or bool(stdin_reply)})
        out = {"msgs": [], "stdout": "", "stderr": "", "results": [], "displays": [], "errors": [], "reply": None}
        idle = False
        deadline = time.monotonic() + timeout
        while not (idle and out["reply"]):
            m = self.recv(max(1, deadline - time.monotonic()))
            if m["parent_header"].get("msg_id") != mid:
                continue
            out["msgs"].append(m)
            t, c = m["msg_type"], m["content"]
            if t == "stream":
                out[c["name"]] += c["text"]
            elif t == "execute_result":
                out["results"].append(c["data"])
            elif t == "display_data":
                out["displays"].append(c["data"])
            elif t == "error":
                out["errors"].append(c)
            elif t == "execute_reply":
                out["reply"] = c
            elif t == "input_request" and stdin_reply is not None:
                self.send("input_reply", {"value": stdin_reply}, channel="stdin", parent=m["header"])
            elif t == "status" and c["execution_state"] == "idle":
                idle = True
        return out

    def close(self):
        self.ws.close()


@pytest.fixture(scope="module")
def gateway(home, tmp_path_factory):
    gw = Gateway(home, tmp_path_factory.mktemp("gw"), env={"SANDGATE_MAX_KERNELS": "4"})
    yield gw
    gw.stop()


# gVisor twice: the system's runsc (Debian 12's stops a sandbox to checkpoint it) and Debian 13's,
# fetched under the home as `sandgate image runsc` does, which checkpoints in place.
DRIVERS = ["gvisor", "gvisor-runsc-trixie", "qemu"]


@pytest.fixture(scope="module", params=DRIVERS)
def driver_gw(request, home, tmp_path_factory):
    """A gateway per driver (cold starts, so a boot is a boot), ``.driver`` naming it."""
    if request.param == "qemu":
        from sandgate_images import vm

        vm.build(home)
    env = {"SANDGATE_WARM_START": "false"}
    if request.param == "gvisor-runsc-trixie":
        from sandgate_images import runsc

        env["SANDGATE_RUNSC"] = str(runsc.fetch(home))
    g = Gateway(home, tmp_path_factory.mktemp(request.param), env=env)
    g.driver = request.param.split("-")[0]
    g.in_place = request.param == "gvisor-runsc-trixie"  # its checkpoints leave the sandbox running
    yield g
    g.stop()


@pytest.fixture(scope="module")
def kernel(gateway):
    kid = gateway.start_kernel()
    yield kid
    gateway.request("DELETE", f"/api/kernels/{kid}")


def wait_for(predicate, timeout=60, interval=0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError("condition not met in time")


ANSI = re.compile(r"\x1b\[[0-9;]*m")
