"""Unauthenticated descriptor exhaustion. With tornado's defaults a half-open
request is held for an hour and connections have no cap: ~21,000 of them take
the gateway to its descriptor limit, `GET /api` and a checkpoint time out, and
each failed accept logs a traceback (91 MB in a minute). So
(gateway/connections.py): headers and bodies have deadlines, the
connections still HTTP are capped in total and per client address (503 over
either), websockets leave the count at their upgrade, and accept errors are
logged at a bounded rate while accepting pauses.

Real gateway, real sockets, small caps and timeouts through the settings; floods
come from other loopback addresses (127.0.0.2 and up) than the ordinary client."""

from __future__ import annotations

import logging
import select
import socket
import time

import psutil

from conftest import Gateway, wait_for

HALF = b"GET /api HTTP/1.1\r\nHost: 127.0.0.1\r\n"  # a request whose headers never end


def connect(port: int, src: str, send: bytes = b"") -> socket.socket:
    s = socket.socket()
    s.bind((src, 0))
    s.settimeout(30)
    s.connect(("127.0.0.1", port))
    if send:
        s.sendall(send)
    return s


def answer(s: socket.socket) -> bytes:
    """What the gateway says before it closes ``s`` (b"" for a close or a reset)."""
    data = b""
    try:
        while chunk := s.recv(4096):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def open_on(g: Gateway) -> list:
    """The gateway's connections on its port (listening socket aside)."""
    p = psutil.Process(g.proc.pid)
    conns = p.net_connections("tcp") if hasattr(p, "net_connections") else p.connections("tcp")
    return [c for c in conns if c.laddr and c.laddr.port == g.port and c.status != psutil.CONN_LISTEN]


def refused(port: int, src: str) -> bool:
    """A new connection from ``src`` is answered 503 at once; one that is let in (no answer within 2 s)
    is closed again, so that it holds no place."""
    s = connect(port, src)
    s.settimeout(2)
    try:
        return answer(s).startswith(b"HTTP/1.1 503 ")
    except TimeoutError:
        return False
    finally:
        s.close()


def still_open(socks: list, seconds: float = 1.0) -> bool:
    """None of ``socks`` was answered or closed within ``seconds``."""
    readable, _, _ = select.select(socks, [], [], seconds)
    return not readable


def status(gw: Gateway, path: str):
    """The status of ``GET path``, or None when the connection was refused by a reset."""
    try:
        return gw.request("GET", path, timeout=10).status
    except OSError:
        return None


def metric(gw: Gateway, name: str, **labels) -> float:
    return gw.metrics().get((name, tuple(sorted(labels.items()))), 0.0)


def test_connections_are_capped_per_address_and_in_total(home, tmp_path):
    g = Gateway(home, tmp_path, env={"SANDGATE_WARM_START": "false", "SANDGATE_HTTP_MAX_CONNECTIONS": "25",
                                     "SANDGATE_HTTP_MAX_CONNECTIONS_PER_CLIENT": "10",
                                     "SANDGATE_HTTP_IDLE_TIMEOUT": "300"})  # held for the whole test
    held = []
    try:
        # One address floods: ten half-open requests are held, every one after is answered 503 at once.
        held = [connect(g.port, "127.0.0.2", HALF) for _ in range(10)]
        over = [connect(g.port, "127.0.0.2") for _ in range(20)]
        for s in over:
            assert answer(s).startswith(b"HTTP/1.1 503 ")
            s.close()
        assert still_open(held)
        last = answer(connect(g.port, "127.0.0.2"))
        assert b'"too many connections from this address"' in last, last
        # Everyone else is served meanwhile: the API, the probes (another node of a fleet, a load balancer).
        assert g.request("GET", "/api").status == 200
        assert g.request("GET", "/healthz").status == 200
        assert metric(g, "sandgate_http_refused_total", reason="client") >= 21

        # The total: 25 connections from three addresses, then a fourth address is refused too. First
        # the test's own requests above must be gone from the gateway (it closes them after answering):
        # else one still counted would take a held connection's place.
        wait_for(lambda: len(open_on(g)) == 10, timeout=30)
        held += [connect(g.port, "127.0.0.3", HALF) for _ in range(10)]
        held += [connect(g.port, "127.0.0.4", HALF) for _ in range(5)]
        # A request of this test's that the gateway has answered may hold its place a moment longer (its
        # close is seen after the answer): a probe let in meanwhile is closed, and asked again.
        wait_for(lambda: refused(g.port, "127.0.0.5"), timeout=30)
        wait_for(lambda: refused(g.port, "127.0.0.1"), timeout=30)  # the cap is the cap, for every address
        assert still_open(held)
        # Connections that end leave the count: the gateway serves again, the flooding address too.
        for s in held[10:]:
            s.close()
        wait_for(lambda: status(g, "/api") == 200, timeout=30)
        assert metric(g, "sandgate_http_refused_total", reason="total") >= 2
        for s in held[:10]:
            s.close()
        request = b"GET /api HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        wait_for(lambda: answer(connect(g.port, "127.0.0.2", request)).startswith(b"HTTP/1.1 401 "),
                 timeout=30)  # served (no token): not a 503
        assert "connections: at most 25 (10 per client address)" in g.log_text()
        # Every refusal was logged, but not one line each.
        lines = [x for x in g.log_text().splitlines() if "refused a connection" in x]
        assert 1 <= len(lines) <= 3, lines
    finally:
        for s in held:
            s.close()
        g.stop()


def test_headers_and_bodies_have_deadlines_and_websockets_outlive_them(home, tmp_path):
    g = Gateway(home, tmp_path, env={"SANDGATE_WARM_START": "false", "SANDGATE_HTTP_IDLE_TIMEOUT": "1",
                                     "SANDGATE_HTTP_BODY_TIMEOUT": "1", "SANDGATE_HTTP_MAX_CONNECTIONS_PER_CLIENT": "4"})
    kernels = []
    try:
        kid = g.start_kernel()
        # Six kernel websockets from one address with a cap of four per address: upgraded, they do not count.
        kernels = [g.connect(kid) for _ in range(6)]
        t0 = time.monotonic()
        silent = connect(g.port, "127.0.0.2")
        body = connect(g.port, "127.0.0.2", b"POST /api/sandboxes HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n{")
        assert answer(silent) == b"" and answer(body) == b""
        # A slowloris: one byte of headers every 0.2 s, until the gateway hangs up.
        slow = connect(g.port, "127.0.0.3")
        t1 = time.monotonic()
        try:
            for byte in (HALF + b"X-Pad: " + b"a" * 200):
                slow.sendall(bytes([byte]))
                assert time.monotonic() - t1 < 20, "still reading headers"
                if not still_open([slow], 0.2):
                    break
            else:
                raise AssertionError("the headers never timed out")
            assert answer(slow) == b""
        except (BrokenPipeError, ConnectionResetError):
            pass
        took = time.monotonic() - t1
        print(f"idle, slow body and slow headers closed after {t1 - t0:.2f} s and {took:.2f} s (deadlines: 1 s)")
        assert took < 10
        # Past every deadline, each websocket still carries cells.
        for k in kernels:
            assert k.execute("print(6 * 7)")["stdout"] == "42\n"
        # An ordinary keep-alive client is closed once idle past the deadline, having been served.
        s = connect(g.port, "127.0.0.1", b"GET /api HTTP/1.1\r\nHost: x\r\nAuthorization: token test-token\r\n\r\n")
        assert answer(s).startswith(b"HTTP/1.1 200 ")  # returns at the idle close
    finally:
        for k in kernels:
            k.close()
        g.stop()


def test_accept_errors_are_logged_at_a_bounded_rate_and_the_gateway_recovers(home, tmp_path):
    g = Gateway(home, tmp_path, env={"SANDGATE_WARM_START": "false"})
    flood = []
    proc = psutil.Process(g.proc.pid)
    soft, hard = proc.rlimit(psutil.RLIMIT_NOFILE)
    try:
        # The descriptor table full, as 20,000 connections or busy sandboxes would leave it.
        proc.rlimit(psutil.RLIMIT_NOFILE, (proc.num_fds() + 8, hard))
        flood = [connect(g.port, "127.0.0.2", HALF) for _ in range(40)]
        wait_for(lambda: "Too many open files" in g.log_text(), timeout=30)  # EMFILE, however logged
        size, cpu = len(g.log_text()), sum(proc.cpu_times()[:2])
        # A window of EMFILE: the log and the CPU it may cost are rates, so they need a duration.
        time.sleep(2)
        grown, spent = len(g.log_text()) - size, sum(proc.cpu_times()[:2]) - cpu
        print(f"2 s out of descriptors: the log grew {grown} bytes, the gateway spent {spent:.2f} s of CPU")
        assert grown < 2000 and spent < 0.5, (grown, spent)
        for s in flood:
            s.close()
        proc.rlimit(psutil.RLIMIT_NOFILE, (soft, hard))
        wait_for(lambda: g.request("GET", "/api", timeout=10).status == 200, timeout=30)
        assert metric(g, "sandgate_http_refused_total", reason="accept") >= 1
    finally:
        for s in flood:
            s.close()
        if g.proc.poll() is None:
            proc.rlimit(psutil.RLIMIT_NOFILE, (soft, hard))
        g.stop()


def test_a_client_is_its_address_and_an_ipv6_client_its_64(caplog):
    """Who the per-client cap counts: one host holds a whole IPv6 /64, so one flood cannot
    take a fresh address per connection; an IPv4-mapped address is its IPv4 one. And a
    rate-limited log line: one per 10 s, carrying how many events it stands for."""
    from sandgate.connections import RateLimitedLog, client_of

    assert client_of(("127.0.0.2", 4242)) == "127.0.0.2"
    assert client_of(("2001:db8::1", 1, 0, 0)) == client_of(("2001:db8::ffff:1", 2, 0, 0)) == "2001:db8::/64"
    assert client_of(("2001:db8:0:1::1", 1, 0, 0)) == "2001:db8:0:1::/64"
    assert client_of(("::ffff:10.1.2.3", 1, 0, 0)) == "10.1.2.3"
    assert client_of("") == ""  # a unix socket
    now = [0.0]
    limited = RateLimitedLog(every=10, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="sandgate"):
        for t in range(100):  # 50 s of one event every 0.5 s
            now[0] = t * 0.5
            limited(logging.WARNING, "refused a connection from %s", "x")
    assert [r.getMessage() for r in caplog.records] == [
        f"refused a connection from x ({n} since the last such line)" for n in (1, 20, 20, 20, 20)]
