"""Code in a sandbox must not grow the gateway's memory through the egress proxy: unbounded, its
mitmproxy reads a whole request head before any hook and forwards it upstream.

End to end: a real gateway and a real gVisor sandbox whose cell writes huge heads on a raw socket to its
HTTP(S)_PROXY (plain HTTP, and inside TLS after a CONNECT), real upstream servers on 127.0.0.3/.4 that
record every byte they receive; the gateway's peak RSS from /proc (VmHWM, reset before each cell).
Then the proxy on its own, in this test's loop (test_egress_proxy's harness), for each bound: a header
line, the field count, response heads, the ClientHello, bytes sent ahead of a pending response, a
request body while a hook is in flight (back-pressure, nothing cut), a refused body after a 502."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import logging
import socket
import ssl
import threading

import pytest

from conftest import Gateway
from test_egress_proxy import PLAIN_IP, RESOLVER, SID, TLS_IP, make_ca, proxy_and_bridge, response, run
from sandgate.egress.policy import EgressPolicy

MiB = 1 << 20
# The proxy's bounds (gateway/egress/bounds.py), written out so that these tests run against a proxy
# without them too.
HEAD_MAX, LINE_MAX, FIELDS_MAX = 64 << 10, 16 << 10, 128


# --- upstream servers that record what reaches them ---------------------------------------------

class Recorder:
    """A raw HTTP/1.1 server counting every byte it receives. ``/slow`` answers once ``release`` is
    set, ``/hugehead`` answers with a 1 MiB response head; anything else gets ``200`` and the number of
    body bytes it read (Content-Length)."""

    def __init__(self, ip: str, tls: ssl.SSLContext = None):
        self.received = 0
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.sock = socket.create_server((ip, 0))
        self.tls = tls
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _recv(self, conn):
        data = conn.recv(1 << 16)
        with self.lock:
            self.received += len(data)
        return data

    def _serve(self, conn):
        try:
            if self.tls:
                conn = self.tls.wrap_socket(conn, server_side=True)
            buf = bytearray()
            while True:
                while (end := buf.find(b"\r\n\r\n")) < 0:
                    data = self._recv(conn)
                    if not data:
                        return
                    buf += data
                head, buf = bytes(buf[:end]), buf[end + 4:]
                path = head.split(b" ", 2)[1]
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                while len(buf) < length:
                    data = self._recv(conn)
                    if not data:
                        return
                    buf += data
                del buf[:length]
                if path == b"/slow":
                    self.release.wait(60)
                if path == b"/ws":  # a WebSocket that says hi, then only counts what it receives
                    self.ws_head = head
                    key = next(line.split(b":")[1].strip() for line in head.split(b"\r\n")
                               if line.lower().startswith(b"sec-websocket-key:"))
                    accept = base64.b64encode(hashlib.sha1(key + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest())
                    conn.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                                 b"Sec-WebSocket-Accept: " + accept + b"\r\n\r\n\x81\x02hi")
                    while self._recv(conn):
                        pass
                    return
                if path == b"/hugehead":
                    conn.sendall(b"HTTP/1.1 200 OK\r\nX-Big: " + b"b" * MiB + b"\r\nContent-Length: 0\r\n\r\n")
                    continue
                body = str(length).encode()
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        except (OSError, ValueError, IndexError):
            pass
        finally:
            conn.close()

    def close(self):
        self.sock.close()


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("recorders")
    ca, leaf = make_ca(tmp)
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(leaf)
    plain, tls = Recorder(PLAIN_IP), Recorder(TLS_IP, ctx)
    yield {"ca": ca, "plain": plain, "tls": tls}
    plain.release.set()
    plain.close()
    tls.close()


# --- end to end: a sandbox against the gateway --------------------------------------------------

@pytest.fixture(scope="module")
def egw(home, servers, tmp_path_factory):
    g = Gateway(home, tmp_path_factory.mktemp("hostile-egress"), env={
        "SANDGATE_EGRESS_CA_BUNDLE": str(servers["ca"]),
        "SANDGATE_EGRESS_HOSTS": f"secure.test={TLS_IP},plain.test={PLAIN_IP},denied.test={PLAIN_IP}"})
    yield g
    g.stop()


@pytest.fixture(scope="module")
def sid(egw, servers):
    policy = {"allow": [f"plain.test:{servers['plain'].port}", f"secure.test:{servers['tls'].port}",
                        f"{PLAIN_IP}/32", f"{TLS_IP}/32"]}
    r = egw.request("POST", "/api/sandboxes", {"egress": policy})
    assert r.status == 201, r.body
    sandbox = r.json()["id"]
    yield sandbox
    egw.request("DELETE", f"/api/sandboxes/{sandbox}")


# One huge head on a raw socket to the sandbox's proxy: plain (absolute form), or inside TLS after a
# CONNECT. Prints what came back (the first line) and how many MiB went out before the proxy cut it.
HUGE = r"""
import os, socket, ssl, threading
def huge(target, mib, tls_host=None):
    port = int(os.environ["HTTPS_PROXY"].rsplit(":", 1)[1].rstrip("/"))
    s = socket.create_connection(("127.0.0.1", port), timeout=120)
    if tls_host:
        s.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
        reply = b""
        while b"\r\n\r\n" not in reply:
            reply += s.recv(4096)
        assert reply.startswith(b"HTTP/1.1 200"), reply
        s = ssl.create_default_context().wrap_socket(s, server_hostname=tls_host)
        first = f"GET / HTTP/1.1\r\nHost: {target}\r\n"
    else:
        first = f"GET http://{target}/ HTTP/1.1\r\nHost: {target}\r\n"
    sent, chunk = 0, b"a" * (1 << 20)
    try:
        s.sendall(first.encode() + b"X-Big: ")
        while sent < mib:
            s.sendall(chunk)
            sent += 1
        s.sendall(b"\r\n\r\n")
        reply = s.recv(65536)
    except OSError as e:
        reply = type(e).__name__.encode()
    s.close()
    first_line = reply.split(b"\r\n")[0].decode(errors="replace")
    return f"{first_line} sent={sent}"
"""


def status(gw: Gateway) -> dict:
    return {k: int(v.split()[0]) * 1024 for k, v in
            (line.split(":", 1) for line in open(f"/proc/{gw.proc.pid}/status") if line.startswith("Vm"))}


def reset_peak(gw: Gateway) -> int:
    """Resets the gateway's peak RSS (VmHWM) to its RSS now, and returns that."""
    with open(f"/proc/{gw.proc.pid}/clear_refs", "w") as f:
        f.write("5")
    return status(gw)["VmRSS"]


def run_cell(gw, sid, code, timeout=300):
    out = gw.run_code(sid, code, timeout=timeout)
    assert out.error is None, out.error
    return out.stdout


def test_a_huge_head_to_an_allowed_host_is_refused_unread_and_never_forwarded(egw, sid, servers):
    plain, tls = servers["plain"], servers["tls"]
    # what the proxy must still do: a normal request reaches the recorder (its echo: 0 body bytes)
    ok = run_cell(egw, sid, HUGE.replace("X-Big: ", "X-Small: ") +
                  f"print(huge('plain.test:{plain.port}', 0))")
    assert ok.startswith("HTTP/1.1 200"), ok
    before = plain.received + tls.received
    base = reset_peak(egw)
    out = run_cell(egw, sid, HUGE + f"print(huge('plain.test:{plain.port}', 64))\n"
                                    f"print(huge('secure.test:{tls.port}', 64, tls_host='secure.test'))")
    peak = status(egw)["VmHWM"] - base
    print(f"gateway peak RSS growth: {peak / MiB:.1f} MiB")
    assert plain.received + tls.received == before, out  # not a byte of either head reached upstream
    for line in out.splitlines():  # cut long before the 64 MiB were out
        assert int(line.rsplit("sent=", 1)[1]) < 16, out
    assert peak < 32 * MiB, (peak, out)  # was +491 MB for 100 MiB
    closed = f"sandbox {sid}: connection closed: request head"  # over HEAD_MAX, or a line over LINE_MAX
    assert egw.log_text().count(closed) == 2, egw.log_text()[-3000:]


def test_huge_heads_to_a_refused_host_are_cut_before_they_are_held(egw, sid, servers):
    closed = f"sandbox {sid}: connection closed: request head"
    earlier = egw.log_text().count(closed)
    base = reset_peak(egw)
    out = run_cell(egw, sid, HUGE + (
        "import concurrent.futures as cf\n"
        "with cf.ThreadPoolExecutor(4) as pool:\n"
        f"    for r in pool.map(lambda i: huge('denied.test:{servers['plain'].port}', 48), range(4)): print(r)\n"))
    peak = status(egw)["VmHWM"] - base
    print(f"gateway peak RSS growth: {peak / MiB:.1f} MiB")
    assert len(out.splitlines()) == 4 and all(int(line.rsplit("sent=", 1)[1]) < 16 for line in out.splitlines()), out
    assert peak < 32 * MiB, (peak, out)  # was +863 MB for four of 150 MiB
    assert egw.log_text().count(closed) == earlier + 4


# --- the proxy on its own: each bound -----------------------------------------------------------

def policy(servers):
    return EgressPolicy(allow=[f"plain.test:{servers['plain'].port}", f"secure.test:{servers['tls'].port}",
                               PLAIN_IP, TLS_IP])


def recorder_bundle(servers):
    return {"ca": servers["ca"]}


async def refused(reader) -> bytes:
    """What the proxy answered before it closed (a reset after the answer counts as the close)."""
    data = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := await reader.read(65536):
            data += chunk
    return data


@run
async def test_each_header_line_and_the_field_count_are_bounded(tmp_path, servers):
    plain = servers["plain"]
    target = f"plain.test:{plain.port}"
    async with proxy_and_bridge(tmp_path, recorder_bundle(servers), policy(servers)) as (proxy, _):
        before = plain.received
        for extra, why in ((f"X-Long: {'l' * (LINE_MAX + 1)}\r\n", "head line over"),
                           ("".join(f"X-{i}: v\r\n" for i in range(FIELDS_MAX + 1)), "header fields")):
            reader, writer = await proxy.open(SID)
            writer.write(f"GET http://{target}/ HTTP/1.1\r\nHost: {target}\r\n{extra}\r\n".encode())
            answer = await refused(reader)
            assert answer.startswith(b"HTTP/1.1 431") and why.encode() in answer, answer
            writer.close()
        assert plain.received == before
        # at the bounds, it goes through
        reader, writer = await proxy.open(SID)
        fields = "".join(f"X-{i}: v\r\n" for i in range(FIELDS_MAX - 2))
        writer.write(f"GET http://{target}/ HTTP/1.1\r\nHost: {target}\r\nX-Long: {'l' * 8000}\r\n{fields}\r\n".encode())
        head, _ = await response(reader)
        assert head.startswith(b"HTTP/1.1 200"), head
        writer.close()


@run
async def test_a_huge_response_head_is_a_502(tmp_path, servers):
    target = f"plain.test:{servers['plain'].port}"
    async with proxy_and_bridge(tmp_path, recorder_bundle(servers), policy(servers)) as (proxy, _):
        reader, writer = await proxy.open(SID)
        writer.write(f"GET http://{target}/hugehead HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
        head, body = await response(reader)
        assert head.startswith(b"HTTP/1.1 502") and b"response head" in body, head + body
        writer.close()


@run
async def test_a_huge_client_hello_fails_the_handshake(tmp_path, servers, caplog):
    caplog.set_level(logging.INFO, logger="sandgate.egress")
    target = f"secure.test:{servers['tls'].port}"
    async with proxy_and_bridge(tmp_path, recorder_bundle(servers), policy(servers)) as (proxy, _):
        reader, writer = await proxy.open(SID)
        writer.write(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
        assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
        # a handshake message announcing 8 MiB, in full records of 16 KiB
        record = b"\x16\x03\x01\x40\x00" + b"\x00" * 0x4000
        writer.write(b"\x16\x03\x01\x40\x00" + b"\x01\x80\x00\x00" + b"\x00" * (0x4000 - 4))
        with contextlib.suppress(ConnectionResetError, BrokenPipeError):
            for _ in range(8 * MiB // 0x4000):
                writer.write(record)
                await writer.drain()
        await refused(reader)  # closed, long before 8 MiB
    assert any(f"{SID}: connection closed: TLS ClientHello over" in r.getMessage() for r in caplog.records)


@run
async def test_a_malformed_client_hello_is_not_copied_into_the_log(tmp_path, servers, caplog):
    caplog.set_level(logging.DEBUG)
    target = f"secure.test:{servers['tls'].port}"
    async with proxy_and_bridge(tmp_path, recorder_bundle(servers), policy(servers)) as (proxy, _):
        reader, writer = await proxy.open(SID)
        writer.write(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
        assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
        # one whole record whose handshake message is not a ClientHello mitmproxy can parse
        writer.write(b"\x16\x03\x01\x40\x00" + b"\x01\x00\x3f\xfc" + b"\xee" * (0x4000 - 4))
        await refused(reader)
    failed = [r.getMessage() for r in caplog.records if "ClientHello" in r.getMessage()]
    assert failed and max(len(m) for m in failed) < 1000, [m[:300] for m in failed]


def ws_frame(opcode: int, fin: bool, payload: bytes) -> bytes:
    """A client's WebSocket frame (masked, with a zero key, so the payload is as written)."""
    n = len(payload)
    size = bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + n.to_bytes(2, "big")
    return bytes([(0x80 if fin else 0) | opcode]) + size + b"\0\0\0\0" + payload


@run
async def test_a_websocket_relays_but_one_message_is_bounded(tmp_path, servers, caplog):
    caplog.set_level(logging.INFO, logger="sandgate.egress")
    plain = servers["plain"]
    target = f"plain.test:{plain.port}"
    upgrade = (f"GET http://{target}/ws HTTP/1.1\r\nHost: {target}\r\nUpgrade: websocket\r\n"
               "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
               "Sec-WebSocket-Extensions: permessage-deflate\r\n\r\n").encode()
    async with proxy_and_bridge(tmp_path, recorder_bundle(servers), policy(servers)) as (proxy, _):
        reader, writer = await proxy.open(SID)
        writer.write(upgrade)
        assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 101")
        assert await reader.readexactly(4) == b"\x81\x02hi"  # relayed
        assert b"permessage-deflate" not in plain.ws_head  # no compression offered upstream
        before = plain.received
        writer.write(ws_frame(0x2, True, b"hello"))  # a small message goes through
        while plain.received < before + 11:
            await asyncio.sleep(0.05)
        before = plain.received
        writer.write(ws_frame(0x2, False, b"z" * 60000))  # then one message of 8 MiB, in fragments
        with contextlib.suppress(ConnectionResetError, BrokenPipeError):
            for _ in range(8 * MiB // 60000):
                writer.write(ws_frame(0x0, False, b"z" * 60000))
                await writer.drain()
        await refused(reader)  # closed, long before 8 MiB
        assert plain.received - before < MiB  # none of it relayed: mitmproxy holds a message whole
    assert any(f"{SID}: connection closed: WebSocket message over" in r.getMessage() for r in caplog.records)


@run
async def test_bytes_sent_ahead_of_a_pending_response_are_bounded(tmp_path, servers):
    plain = servers["plain"]
    target = f"plain.test:{plain.port}"
    plain.release.clear()
    try:
        async with proxy_and_bridge(tmp_path, recorder_bundle(servers), policy(servers)) as (proxy, _):
            reader, writer = await proxy.open(SID)
            writer.write(f"GET http://{target}/slow HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
            with contextlib.suppress(ConnectionResetError, BrokenPipeError):
                for _ in range(64):  # while the response is pending: 64 MiB of "next request"
                    writer.write(b"x" * MiB)
                    await writer.drain()
            assert b"200" not in await refused(reader)  # cut off, and the pending request with it
    finally:
        plain.release.set()


@run
async def test_a_body_sent_while_a_hook_waits_is_held_back_not_buffered_or_cut(tmp_path, servers):
    plain = servers["plain"]
    target = f"plain.test:{plain.port}"
    resolving, resolve = asyncio.Event(), asyncio.Event()

    async def slow(host, port):  # the request's hook waits here, as on a slow DNS server
        resolving.set()
        await resolve.wait()
        return await RESOLVER(host, port)

    size = 48 * MiB
    async with proxy_and_bridge(tmp_path, recorder_bundle(servers), policy(servers), resolver=slow) as (proxy, _):
        reader, writer = await proxy.open(SID)
        writer.write(f"POST http://{target}/ HTTP/1.1\r\nHost: {target}\r\nContent-Length: {size}\r\n\r\n".encode())
        await resolving.wait()
        writer.write(b"y" * size)
        # the proxy reads none of it while the hook waits: it stays in this side's buffers
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(writer.drain(), 3)
        assert writer.transport.get_write_buffer_size() > size - 16 * MiB
        resolve.set()
        head, body = await response(reader)  # then all of it goes through
        assert head.startswith(b"HTTP/1.1 200") and int(body) == size, head + body
        writer.close()


@run
async def test_a_large_body_to_an_unresolvable_allowed_name_is_cut_not_read(tmp_path, servers):
    async with proxy_and_bridge(tmp_path, recorder_bundle(servers),
                                EgressPolicy(allow=["nowhere.test"])) as (proxy, _):
        reader, writer = await proxy.open(SID)
        writer.write(f"POST http://nowhere.test/ HTTP/1.1\r\nHost: nowhere.test\r\n"
                     f"Content-Length: {1 << 30}\r\n\r\n".encode())
        assert await refused(reader) == b""  # closed at once: no 1 GB read to answer a 502


@run
async def test_h2_is_never_negotiated_with_the_client(tmp_path, servers):
    target = f"secure.test:{servers['tls'].port}"
    async with proxy_and_bridge(tmp_path, recorder_bundle(servers), policy(servers)) as (proxy, _):
        reader, writer = await proxy.open(SID)
        writer.write(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
        assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
        ctx = ssl.create_default_context(cadata=proxy.ca_certificate_pem().decode())
        ctx.set_alpn_protocols(["h2", "http/1.1"])
        await writer.start_tls(ctx, server_hostname="secure.test")
        # HTTP/1 only, so the head bounds above are the only header-list bounds there are
        assert writer.get_extra_info("ssl_object").selected_alpn_protocol() == "http/1.1"
        writer.close()
