"""Egress carried over the agent's stream, end to end.

The real core (manager, sandbox lifecycle, agent link) runs in this process on
the real drivers; code inside real sandboxes uses urllib through the agent's
listener on 127.0.0.1:3128. On the host side a small forward proxy on
127.0.0.3 stands in for the egress proxy (absolute-form GET, CONNECT), in
front of real HTTP and HTTPS servers on 127.0.0.4 named ``upstream.test``:
the sandbox has no DNS, the proxy resolves. The HTTPS server's certificate
is signed by a CA of this test, which reaches the sandbox only through the
hook's ``ca_pem``, so an HTTPS request that verifies proves the CA bundle.
"""

from __future__ import annotations

import asyncio
import hashlib
import http.server
import json
import socketserver
import ssl
import subprocess
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from sandgate.config import Settings
from sandgate.core.manager import SandboxManager
from sandgate.core.service import SandboxService, StartRequest
from sandgate.core.states import State
from sandgate.core.tunnel import EgressHook
from sandgate.drivers.gvisor import GVisorDriver
from sandgate.drivers.qemu import QemuDriver
from sandgate.kernelspecs import KernelSpecs
from sandgate.store.sqlite import SQLiteStore
from sandgate_agent import protocol as P
from sandgate_agent import tunnel as T

UPSTREAM_IP, PROXY_IP = "127.0.0.4", "127.0.0.3"
HOST = "upstream.test"
BIG = 3 << 20  # bytes in /big: a dozen windows
HUGE = 32 << 20  # bytes in /huge, for a client that stops reading


def big_body() -> bytes:
    block = hashlib.sha256(b"sandgate").digest() * 2048  # 64 KiB
    return (block * (BIG // len(block) + 1))[:BIG]


# -- host side: upstream servers, the proxy stand-in ------------------------------------
class Upstream(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    slow_started = threading.Event()
    slow_release = threading.Event()

    def log_message(self, *a):
        pass

    def do_GET(self):
        if self.path.startswith("/slow"):
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()
            self.wfile.write(b"x" * 10)
            self.wfile.flush()
            Upstream.slow_started.set()
            Upstream.slow_release.wait(120)
            try:
                self.wfile.write(b"x" * 990)
            except OSError:
                pass
            return
        if self.path.startswith("/huge"):
            self.send_response(200)
            self.send_header("Content-Length", str(HUGE))
            self.end_headers()
            block = b"h" * (1 << 20)
            try:
                for _ in range(HUGE >> 20):
                    self.wfile.write(block)
            except OSError:
                pass
            return
        body = big_body() if self.path.startswith("/big") else f"hello from upstream {self.path}".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)


class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True


def make_ca(tmp: Path) -> tuple:
    """A CA and a certificate for upstream.test signed by it (openssl)."""
    def run(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=tmp)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=sandgate test egress CA",
        "-keyout", "ca.key", "-out", "ca.pem")
    run("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={HOST}", "-keyout", "srv.key", "-out", "srv.csr")
    (tmp / "ext").write_text(f"subjectAltName=DNS:{HOST}\n")
    run("x509", "-req", "-in", "srv.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-days", "2",
        "-extfile", "ext", "-out", "srv.pem")
    return tmp / "ca.pem", tmp / "srv.pem", tmp / "srv.key"


class StandInProxy:
    """A forward proxy: absolute-form requests and CONNECT, names resolved
    here. Counts what it served per sandbox (the connector names it)."""

    def __init__(self):
        self.requests: list = []  # (method, target)

    async def start(self):
        self.server = await asyncio.start_server(self.handle, PROXY_IP, 0)
        self.port = self.server.sockets[0].getsockname()[1]

    @staticmethod
    def resolve(host: str) -> str:
        if host != HOST:
            raise OSError(f"unknown host {host}")
        return UPSTREAM_IP

    async def handle(self, r: asyncio.StreamReader, w: asyncio.StreamWriter):
        try:
            head = await r.readuntil(b"\r\n\r\n")
            line, *headers = head[:-4].split(b"\r\n")
            method, target, _ = line.decode().split(" ")
            self.requests.append((method, target))
            if method == "CONNECT":
                host, port = target.rsplit(":", 1)
                ur, uw = await asyncio.open_connection(self.resolve(host), int(port))
                w.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            else:
                u = urlsplit(target)
                ur, uw = await asyncio.open_connection(self.resolve(u.hostname), u.port or 80)
                keep = [h for h in headers if not h.lower().startswith((b"proxy-connection:", b"connection:"))]
                uw.write(f"{method} {u.path or '/'}{'?' + u.query if u.query else ''} HTTP/1.1\r\n".encode()
                         + b"".join(h + b"\r\n" for h in keep) + b"Connection: close\r\n\r\n")
        except Exception:
            w.transport.abort()
            return

        async def pipe(src, dst):
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
                if dst.can_write_eof():
                    dst.write_eof()
            except Exception:
                dst.transport.abort()

        await asyncio.gather(pipe(r, uw), pipe(ur, w))
        w.close()
        uw.close()


# -- the core, in a loop of its own ----------------------------------------------------------
class Loop:
    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def __call__(self, coro, timeout=300):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def env(home, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("egress")
    ca, cert, key = make_ca(tmp)
    http_srv = Server((UPSTREAM_IP, 0), Upstream)
    https_srv = Server((UPSTREAM_IP, 0), Upstream)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    https_srv.socket = ctx.wrap_socket(https_srv.socket, server_side=True)
    for s in (http_srv, https_srv):
        threading.Thread(target=s.serve_forever, daemon=True).start()
    loop = Loop()
    proxy = StandInProxy()
    loop(proxy.start())
    connected: list = []

    async def connect(sandbox_id: str):
        connected.append(sandbox_id)
        return await asyncio.open_connection(PROXY_IP, proxy.port)

    gw_home = tmp / "home"
    gw_home.mkdir()
    (gw_home / "images").symlink_to(home / "images")

    async def make():
        s = Settings.load(home=gw_home, warm_start=False, max_kernels=6)  # SANDGATE_RUNSC and such as given
        drivers = {"gvisor": GVisorDriver(str(gw_home / "runtime" / "gvisor"), s)}
        if QemuDriver.probe(s)[0]:
            drivers["qemu"] = QemuDriver(str(gw_home / "runtime" / "qemu"), s)
        m = SandboxManager(s, drivers, KernelSpecs(list(drivers), "gvisor"), SQLiteStore(gw_home / "sessions.db"))
        m.egress = EgressHook(connect=connect, ca_pem=ca.read_text())
        return SandboxService(m)

    svc = loop(make())
    e = type("Env", (), dict(loop=loop, svc=svc, proxy=proxy, connected=connected,
                             http=f"http://{HOST}:{http_srv.server_address[1]}",
                             https=f"https://{HOST}:{https_srv.server_address[1]}"))
    yield e
    Upstream.slow_release.set()
    for sb in list(svc.manager.sandboxes.values()):
        try:
            loop(svc.delete(sb.id), 120)
        except Exception:
            pass
    loop.stop()
    http_srv.shutdown()
    https_srv.shutdown()


@pytest.fixture(scope="module", params=["gvisor", "qemu"])
def sandbox(request, env, home):
    if request.param == "qemu":
        if "qemu" not in env.svc.manager.drivers:
            pytest.skip("qemu is not available here")
        from sandgate_images import vm

        vm.build(home)
    sb = env.loop(env.svc.start(StartRequest(driver=request.param)), 600)
    env.loop(sb.set_egress(3128))
    yield sb
    try:
        env.loop(env.svc.delete(sb.id), 120)
    except Exception:
        pass


def cell(env, sb, code: str, timeout=120) -> str:
    r = env.loop(env.svc.execute(sb.id, code, timeout), timeout + 60)
    assert r["status"] == "ok", r
    return r["stdout"]


def fetch(env, sb, url: str) -> str:
    """A GET with urllib from inside the kernel: status and body (or what failed)."""
    return cell(env, sb, f"""
import urllib.request
try:
    with urllib.request.build_opener().open({url!r}, timeout=60) as _r:
        print(_r.status, _r.read().decode())
except Exception as _e:
    print("FAILED", type(_e).__name__, _e)
""").strip()


# -- the tests ----------------------------------------------------------------------------------
def test_http_https_and_env(env, sandbox):
    """Plain HTTP (absolute-form through the proxy), HTTPS through CONNECT with
    the proxy's CA trusted via the bundle, and the environment as set."""
    before = len(env.connected)
    assert fetch(env, sandbox, env.http + "/one") == "200 hello from upstream /one"
    assert ("GET", env.http + "/one") in env.proxy.requests
    assert fetch(env, sandbox, env.https + "/two") == "200 hello from upstream /two"
    assert ("CONNECT", env.https[len("https://"):]) in env.proxy.requests
    assert env.connected[before:] == [sandbox.id, sandbox.id]
    got = json.loads(cell(env, sandbox, "import os, json; print(json.dumps(dict(os.environ)))"))
    assert got["HTTP_PROXY"] == got["https_proxy"] == "http://127.0.0.1:3128"
    assert got["NO_PROXY"] == "localhost,127.0.0.1,::1"
    bundle = got["SSL_CERT_FILE"]
    assert got["REQUESTS_CA_BUNDLE"] == got["CURL_CA_BUNDLE"] == got["PIP_CERT"] == bundle
    assert not bundle.startswith("/workspace")
    # the bundle is the system's plus the test CA: both verify
    text = cell(env, sandbox, f"print(open({bundle!r}).read())")
    assert env.svc.manager.egress.ca_pem.strip() in text
    # the sandbox user can read it, not change it
    assert cell(env, sandbox, f"import os; print(os.access({bundle!r}, os.W_OK), "
                              f"os.access(os.path.dirname({bundle!r}), os.W_OK))") == "False False\n"
    n = cell(env, sandbox, f"import ssl; c = ssl.create_default_context(cafile={bundle!r}); "
                           "print(len(c.get_ca_certs()))")
    assert int(n) > 50  # Debian's roots and ours
    # commands get the environment too
    result, out = env.loop(sandbox.link.request("exec", {"argv": ["/usr/bin/env"]}))
    assert result["exit_code"] == 0 and b"HTTPS_PROXY=http://127.0.0.1:3128" in out


def test_big_download_is_flow_controlled(env, sandbox):
    """3 MiB through a 256 KiB window: it all arrives, intact, while the
    kernel answers other cells meanwhile."""
    digest = hashlib.sha256(big_body()).hexdigest()
    out = cell(env, sandbox, f"""
import hashlib, urllib.request
with urllib.request.build_opener().open({env.http + '/big'!r}, timeout=120) as _r:
    _b = _r.read()
print(len(_b), hashlib.sha256(_b).hexdigest())
""", timeout=240)
    assert out.split() == [str(BIG), digest]


def test_stalled_client_is_held_back_and_kernel_answers(env, sandbox):
    """A client inside that stops reading a 32 MiB download: the gateway
    stops sending after a window (plus socket buffers), cells still run
    at once, and once the client reads again all of it arrives."""
    cell(env, sandbox, f"""
import threading, urllib.request
_stall = threading.Event()
_huge = {{}}
def _go():
    try:
        with urllib.request.build_opener().open({env.http + '/huge'!r}, timeout=120) as _r:
            _huge['first'] = len(_r.read(1))
            _stall.wait(120)
            _huge['rest'] = len(_r.read())
    except Exception as _e:
        _huge['error'] = repr(_e)
threading.Thread(target=_go, daemon=True).start()
""")
    deadline = time.monotonic() + 60
    while "first" not in json.loads(cell(env, sandbox, "import json; print(json.dumps(_huge))")):
        assert time.monotonic() < deadline, "the download never started"
    conns = list(sandbox.link.tunnels.conns.values())
    assert len(conns) == 1
    t0 = time.monotonic()
    assert cell(env, sandbox, "print(6 * 7)") == "42\n"  # kernel messages pass the stalled connection
    assert time.monotonic() - t0 < 10
    sent = conns[0].sent
    assert sent < HUGE // 2, sent  # held back: a window plus what the sockets buffer, not the whole body
    assert conns[0].credit < T.WINDOW  # waiting for the client, not idle
    cell(env, sandbox, "_stall.set()")
    deadline = time.monotonic() + 240
    while True:
        got = json.loads(cell(env, sandbox, "import json; print(json.dumps(_huge))"))
        if "rest" in got or "error" in got or time.monotonic() > deadline:
            break
    assert got.get("first", 0) + got.get("rest", 0) == HUGE, got


def test_proxy_unreachable_fails_fast(env, sandbox):
    """The gateway cannot reach the proxy: the client inside gets the
    connection closed at once, no hang, and the next request works again."""
    hook = env.svc.manager.egress
    real = hook.connect

    async def refuse(sandbox_id):
        raise ConnectionRefusedError("the egress proxy is down (test)")

    hook.connect = refuse
    try:
        t0 = time.monotonic()
        out = fetch(env, sandbox, env.http + "/down")
        assert out.startswith("FAILED") and time.monotonic() - t0 < 30, out
    finally:
        hook.connect = real
    assert fetch(env, sandbox, env.http + "/up") == "200 hello from upstream /up"


def test_off_and_on_while_running(env, sandbox):
    env.loop(sandbox.set_egress(None))
    assert sandbox.record.egress_port is None
    assert cell(env, sandbox, "import os; print(os.environ.get('HTTP_PROXY'), os.environ.get('SSL_CERT_FILE'))") \
        == "None None\n"
    # no proxy in the environment: urllib goes direct, and there is no way out (no DNS, no network)
    out = fetch(env, sandbox, env.http + "/off")
    assert out.startswith("FAILED URLError"), out
    # and the listener is gone
    out = cell(env, sandbox, """
import socket
try:
    socket.create_connection(("127.0.0.1", 3128), timeout=10)
    print("connected")
except OSError as _e:
    print(type(_e).__name__)
""")
    assert out.strip() == "ConnectionRefusedError"
    env.loop(sandbox.set_egress(3128))
    assert fetch(env, sandbox, env.http + "/on-again") == "200 hello from upstream /on-again"


def test_checkpoint_fork_and_inflight(env, sandbox):
    """Egress on through a checkpoint: a connection open at the checkpoint
    fails at once (reset), the listener is back in the original, and a fork
    from the checkpoint gets its own once egress is set on it."""
    # The module's gateway is set up again for the slow (qemu) group, after the first group's
    # teardown released every slow response: hold this one until the end again.
    Upstream.slow_release.clear()
    Upstream.slow_started.clear()
    cell(env, sandbox, f"""
import threading, time, urllib.request
_inflight = {{}}
def _go():
    t0 = time.time()
    try:
        with urllib.request.build_opener().open({env.http + '/slow'!r}, timeout=120) as _r:
            _inflight['body'] = len(_r.read())
    except Exception as _e:
        _inflight['error'] = type(_e).__name__ + ': ' + str(_e)
    _inflight['seconds'] = time.time() - t0
threading.Thread(target=_go, daemon=True).start()
""")
    assert Upstream.slow_started.wait(60), "the slow request never reached the upstream"
    assert len(sandbox.link.tunnels.conns) == 1
    cp = env.loop(env.svc.checkpoint(sandbox.id, "egress"), 600)
    assert sandbox.state == State.RUNNING
    deadline = time.monotonic() + 60
    while True:
        got = json.loads(cell(env, sandbox, "import json; print(json.dumps(_inflight))"))
        if "seconds" in got or time.monotonic() > deadline:
            break
    assert "error" in got and "body" not in got, got
    assert got["seconds"] < 60, got  # failed, not timed out
    assert fetch(env, sandbox, env.http + "/after-checkpoint") == "200 hello from upstream /after-checkpoint"

    fork = env.loop(env.svc.fork(sandbox.id, checkpoint=cp.id), 600)
    try:
        # a fork starts without egress until it is given (the record is its own)...
        assert fetch(env, fork, env.http + "/fork-off").startswith("FAILED")
        env.loop(fork.set_egress(3128))
        before = len(env.connected)
        assert fetch(env, fork, env.http + "/fork") == "200 hello from upstream /fork"
        assert env.connected[before:] == [fork.id]
        # ...and both copies then work side by side
        assert fetch(env, sandbox, env.https + "/original") == "200 hello from upstream /original"
    finally:
        env.loop(env.svc.delete(fork.id), 120)


def test_pause_to_disk_and_resume(env, sandbox):
    env.loop(env.svc.pause(sandbox.id, "disk"), 600)
    assert sandbox.state == State.PAUSED
    env.loop(env.svc.resume(sandbox.id), 600)
    assert fetch(env, sandbox, env.https + "/resumed") == "200 hello from upstream /resumed"


# -- the multiplexer alone, in process ----------------------------------------------------------
def test_mux_flow_control_and_errors():
    """A sender stops after one window until acknowledged; data past the
    window closes that connection only; an open without an opener is
    refused; bytes, eof and close travel as they should."""

    async def main():
        def decode(data: bytes):
            hlen, plen = P.PREFIX.unpack(data[:8])
            return P.parse_header(data[8:8 + hlen]), data[8 + hlen:8 + hlen + plen]

        async def next_frame(q):
            return decode(await asyncio.wait_for(q.get(), 10))

        # 1. the agent side: a local client writes 1 MiB; the peer acknowledges nothing
        out_a: asyncio.Queue = asyncio.Queue()
        a = T.Mux(out_a.put, window=64 << 10, chunk=16 << 10)
        lsrv = await asyncio.start_server(lambda r, w: a.connect(r, w), "127.0.0.3", 0)
        cr, cw = await asyncio.open_connection("127.0.0.3", lsrv.sockets[0].getsockname()[1])
        cw.write(b"y" * (1 << 20))
        f, _ = await next_frame(out_a)
        assert f.op == "open"
        cid, got = f.conn, 0
        while got < 64 << 10:
            f, payload = await next_frame(out_a)
            assert f.op == "data" and f.conn == cid and len(payload) <= 16 << 10
            got += len(payload)
        assert got == 64 << 10
        with pytest.raises(asyncio.TimeoutError):  # nothing more without credit
            await asyncio.wait_for(out_a.get(), 0.5)
        a.on_frame(P.TunnelFrame(conn=cid, op="ack", n=16 << 10), b"")
        f, payload = await next_frame(out_a)
        assert f.op == "data" and len(payload) == 16 << 10
        # the peer closes it: the local client sees the connection end
        a.on_frame(P.TunnelFrame(conn=cid, op="close"), b"")
        assert cid not in a.conns
        with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
            await asyncio.wait_for(cr.readexactly(1), 10)
        # an open on the side without an opener is refused
        a.on_frame(P.TunnelFrame(conn=99, op="open"), b"")
        f, _ = await next_frame(out_a)
        assert (f.conn, f.op, f.error) == (99, "close", "egress is off")

        # 2. the gateway side, an echo server behind its opener
        async def echo(r, w):
            while data := await r.read(65536):
                w.write(data)
                await w.drain()
            w.write_eof()

        esrv = await asyncio.start_server(echo, "127.0.0.3", 0)
        out_b: asyncio.Queue = asyncio.Queue()
        b = T.Mux(out_b.put, opener=lambda: asyncio.open_connection("127.0.0.3", esrv.sockets[0].getsockname()[1]),
                  window=64 << 10)
        b.on_frame(P.TunnelFrame(conn=1, op="open"), b"")
        b.on_frame(P.TunnelFrame(conn=1, op="data"), b"hello")  # before the opener is done: kept
        b.on_frame(P.TunnelFrame(conn=1, op="eof"), b"")
        seen = []
        while not (seen and seen[-1][0] == "eof"):
            f, payload = await next_frame(out_b)
            seen.append((f.op, payload if f.op == "data" else f.n))
        assert ("ack", 5) in seen and ("data", b"hello") in seen
        assert 1 not in b.conns  # both sides said eof: finished
        # data past the window (before the connection is even made) closes that connection only
        b.on_frame(P.TunnelFrame(conn=2, op="open"), b"")
        b.on_frame(P.TunnelFrame(conn=3, op="open"), b"")
        b.on_frame(P.TunnelFrame(conn=2, op="data"), b"z" * (64 << 10))
        b.on_frame(P.TunnelFrame(conn=2, op="data"), b"z")
        f, _ = await next_frame(out_b)
        assert (f.conn, f.op) == (2, "close") and "window" in f.error
        assert 2 not in b.conns and 3 in b.conns
        assert await b.close_all("done") == 1
        for s in (lsrv, esrv):
            s.close()

    asyncio.run(asyncio.wait_for(main(), 60))
