"""The gateway holds when its clients and sandboxes are hostile, in bounded memory.
Real gateway, real gVisor sandboxes, real HTTP and websocket clients; the gateway's RSS read
with psutil as test_gateway_bounds.py does."""

from __future__ import annotations

import hashlib
import json
import socket
import threading
import zlib

import psutil
import pytest
import websocket

from conftest import Gateway, wait_for
from core_harness import make, run, start
from sandgate_agent import protocol as P

MiB = 1 << 20


def rss(gw: Gateway) -> int:
    return psutil.Process(gw.proc.pid).memory_info().rss


BUDGET_MB = 96  # SANDGATE_CLIENT_MEMORY_MB of the module's gateway
CLIENTS = 4  # SANDGATE_MAX_CLIENTS_PER_KERNEL


@pytest.fixture(scope="module")
def gw(home, tmp_path_factory):
    g = Gateway(home, tmp_path_factory.mktemp("hostile-memory"),
                env={"SANDGATE_CLIENT_MEMORY_MB": str(BUDGET_MB), "SANDGATE_MAX_CLIENTS_PER_KERNEL": str(CLIENTS),
                     "SANDGATE_IOPUB_DATA_RATE": "0"})
    yield g
    g.stop()


@pytest.fixture(scope="module")
def sid(gw):
    r = gw.request("POST", "/api/sandboxes", {})
    assert r.status == 201, r.body
    yield r.json()["id"]
    gw.request("DELETE", f"/api/sandboxes/{r.json()['id']}")


class Peak:
    """The gateway's highest RSS while the block runs, sampled every 20 ms."""

    def __init__(self, gw: Gateway):
        self.proc, self.peak, self.done = psutil.Process(gw.proc.pid), 0, threading.Event()

    def _sample(self):
        while not self.done.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            self.done.wait(0.02)

    def __enter__(self):
        self.base = self.proc.memory_info().rss
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()

    @property
    def growth(self) -> int:
        return self.peak - self.base


def client_bytes(gw: Gateway) -> float:
    return gw.metrics()[("sandgate_client_bytes", ())]


def raw_request(gw: Gateway, head: str, body: bytes = b"") -> socket.socket:
    """A client that sends a request and then reads nothing (a small receive buffer)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", gw.port))
    s.sendall(head.encode() + b"\r\n" + body)
    return s


def answer_begun(s: socket.socket) -> bool:
    try:
        return s.recv(16, socket.MSG_PEEK | socket.MSG_DONTWAIT).startswith(b"HTTP/1.1 ")
    except BlockingIOError:
        return False


@pytest.fixture(scope="module")
def e2b_box(gw):
    """An E2B sandbox: (its id, the headers of its envd calls)."""
    r = gw.request("POST", "/e2b/sandboxes", {"templateID": "base"}, token="", headers={"X-API-KEY": gw.token})
    assert r.status == 201, r.body
    box = r.json()
    yield box["sandboxID"], {"E2b-Sandbox-Id": box["sandboxID"], "E2b-Sandbox-Port": "49983",
                             "X-Access-Token": box["envdAccessToken"]}
    gw.request("DELETE", f"/e2b/sandboxes/{box['sandboxID']}", token="", headers={"X-API-KEY": gw.token})


def gzip_of_zeros(n: int) -> bytes:
    """``n`` zero bytes gzipped (about n / 1000), made without holding them."""
    z = zlib.compressobj(6, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    zeros = bytes(MiB)
    return b"".join([*(z.compress(zeros) for _ in range(n // MiB)), z.flush()])


def test_a_gzip_bomb_is_refused_as_it_inflates_not_after(gw, e2b_box):
    """Inflated whole, a 1 MB gzip body of zeros takes the gateway from 152 MB to 2.2 GB and a 500."""
    sid, headers = e2b_box
    bomb = gzip_of_zeros(300 * MiB)
    assert len(bomb) < MiB
    before = rss(gw)
    r = gw.request("POST", "/e2b/files?path=bomb.bin", token="", raw=bomb,
                   headers={**headers, "Content-Type": "application/octet-stream", "Content-Encoding": "gzip"})
    assert r.status == 413, (r.status, r.body)
    body = r.json()
    assert body["code"] == 413 and "SANDGATE_MAX_MESSAGE_MB" in body["message"], body  # E2B's error shape
    assert rss(gw) - before < 100 * MiB
    # Nothing was written, and the sandbox is fine: a real gzip upload still lands.
    r = gw.request("GET", "/e2b/files?path=bomb.bin", token="", headers=headers)
    assert r.status == 404, r.body
    z = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    small = z.compress(b"inflated fine") + z.flush()
    r = gw.request("POST", "/e2b/files?path=ok.txt", token="", raw=small,
                   headers={**headers, "Content-Type": "application/octet-stream", "Content-Encoding": "gzip"})
    assert r.status == 200, r.body
    assert gw.request("GET", "/e2b/files?path=ok.txt", token="", headers=headers).body == b"inflated fine"


def test_file_reads_travel_in_chunks_a_client_that_does_not_read_holds_one(gw, sid):
    """Read whole, 4 GETs of a 250 MiB file whose clients do not read would hold +1.25 GB."""
    size = 200 * MiB
    r = gw.request("POST", f"/api/sandboxes/{sid}/execute", {"timeout": 300, "code": (
        "import hashlib, os\nh = hashlib.sha256()\nwith open('big.bin', 'wb') as f:\n"
        f"    for i in range({size // MiB}):\n        b = os.urandom(1 << 20); h.update(b); f.write(b)\n"
        "print(h.hexdigest())")})
    digest = r.json()["stdout"].strip()
    assert r.status == 200 and len(digest) == 64, r.body
    head = (f"GET /api/sandboxes/{sid}/files/big.bin HTTP/1.1\r\nHost: x\r\n"
            f"Authorization: token {gw.token}\r\n")
    with Peak(gw) as peak:
        stalled = [raw_request(gw, head) for _ in range(4)]
        try:
            wait_for(lambda: all(answer_begun(s) for s in stalled), 120)
            # Each is waiting on its flush: one chunk each held, on the budget's gauge.
            wait_for(lambda: 0 < client_bytes(gw) <= 8 * MiB, 60)
        finally:
            stalled_one = stalled.pop()
            for s in stalled:
                s.close()
    assert peak.growth < 100 * MiB, peak.growth >> 20  # was over 800 MiB: the file, four times
    # Nothing lost: the stalled client that reads at last gets every byte.
    with stalled_one:
        stalled_one.settimeout(120)
        f = stalled_one.makefile("rb")
        status = f.readline()
        headers = {}
        for line in iter(f.readline, b"\r\n"):
            k, _, v = line.decode().partition(":")
            headers[k.strip().lower()] = v.strip()
        assert status.startswith(b"HTTP/1.1 200") and int(headers["content-length"]) == size
        h, got = hashlib.sha256(), 0
        while got < size:
            b = f.read(min(MiB, size - got))
            assert b, got
            h.update(b)
            got += len(b)
        assert h.hexdigest() == digest
    wait_for(lambda: client_bytes(gw) == 0, 30)  # every stalled one's chunk given back


def test_an_execute_body_past_its_bound_is_refused_before_it_is_read(gw, sid):
    """Read before any check, 3 execute calls with 60 MiB bodies would hold +857 MB."""
    body = json.dumps({"code": "#" + "x" * (60 * MiB)}).encode()
    results = []

    def call():
        results.append(gw.request("POST", f"/api/sandboxes/{sid}/execute", raw=body))

    with Peak(gw) as peak:
        threads = [threading.Thread(target=call) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert len(results) == 3
    for r in results:
        assert r.status == 413, (r.status, r.body[:300])
        assert "SANDGATE_MAX_CODE_MB" in r.json()["message"] and r.json()["code"] == "too_large"
    assert peak.growth < 60 * MiB, peak.growth >> 20
    # Under the bound, a big cell still runs.
    code = "n = len('" + "y" * (12 * MiB) + "')\nprint(n)"
    r = gw.request("POST", f"/api/sandboxes/{sid}/execute", {"code": code, "timeout": 120})
    assert r.status == 200 and r.json()["stdout"] == f"{12 * MiB}\n", r.body[:300]


def test_past_the_budget_new_requests_get_503_with_retry_after(gw, e2b_box):
    """One budget of what the gateway holds for clients, with a gauge; past it, 503."""
    assert gw.metrics()[("sandgate_client_bytes_limit", ())] == BUDGET_MB * MiB
    head = (f"POST /api/sandboxes HTTP/1.1\r\nHost: x\r\nAuthorization: token {gw.token}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {60 * MiB}\r\n")
    # Two bodies being sent, and not finished: the gateway holds what arrived.
    slow = [raw_request(gw, head, b'{"labels": {"a": "' + b"x" * (50 * MiB)) for _ in range(2)]
    try:
        wait_for(lambda: client_bytes(gw) >= BUDGET_MB * MiB, 30)
        refused_before = gw.metrics()[("sandgate_busy_refusals_total", ())]
        r = gw.request("GET", "/api/sandboxes")
        assert r.status == 503 and r.headers["Retry-After"] == "1", (r.status, r.body)
        assert r.json()["code"] == "busy" and "SANDGATE_CLIENT_MEMORY_MB" in r.json()["message"], r.body
        _, headers = e2b_box  # E2B's callers get E2B's error shape
        r = gw.request("GET", "/e2b/health", token="", headers=headers)
        assert r.status == 503 and r.json()["code"] == 503 and "SANDGATE_CLIENT_MEMORY_MB" in r.json()["message"]
        assert gw.metrics()[("sandgate_busy_refusals_total", ())] >= refused_before + 2
    finally:
        for s in slow:
            s.close()
    wait_for(lambda: client_bytes(gw) == 0, 30)  # given back when the connections went
    assert gw.request("GET", "/api/sandboxes").status == 200


def test_a_kernel_takes_a_bounded_number_of_websockets(gw, sid):
    """Unbounded, 20 websocket clients of one kernel that do not read would hold +369 MB. Past
    SANDGATE_MAX_CLIENTS_PER_KERNEL a websocket is refused, saying why."""
    url = f"ws://127.0.0.1:{gw.port}/api/kernels/{sid}/channels?token={gw.token}"
    clients = [websocket.create_connection(url, timeout=60) for _ in range(CLIENTS)]
    try:
        refused = 0
        for _ in range(20 - CLIENTS):
            with pytest.raises(websocket.WebSocketBadStatusException) as e:
                websocket.create_connection(url, timeout=60)
            assert e.value.status_code == 403 and b"SANDGATE_MAX_CLIENTS_PER_KERNEL" in e.value.resp_body
            refused += 1
        assert refused == 16 and gw.request("GET", f"/api/kernels/{sid}").json()["connections"] == CLIENTS
        # An execute call is not a websocket: it still runs.
        r = gw.request("POST", f"/api/sandboxes/{sid}/execute", {"code": "print('still runs')"})
        assert r.json()["stdout"] == "still runs\n", r.body
        clients.pop().close()  # one goes: one more may come
        clients.append(wait_for(lambda: _connect_or_none(url), 30))
    finally:
        for c in clients:
            c.close()


def _connect_or_none(url):
    try:
        return websocket.create_connection(url, timeout=60)
    except websocket.WebSocketBadStatusException:
        return None


def test_uploads_travel_in_chunks_and_a_broken_one_leaves_nothing(gw, sid):
    """The other way: an upload's body reaches the sandbox a chunk at a time, never whole in the gateway."""
    size = 60 * MiB
    data = bytes(range(256)) * (size // 256)
    results = []

    def put(i):
        results.append(gw.request("PUT", f"/api/sandboxes/{sid}/files/up/{i}.bin", raw=data,
                                  headers={"Content-Type": "application/octet-stream"}))

    with Peak(gw) as peak:
        threads = [threading.Thread(target=put, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert [r.status for r in results] == [201] * 3, [r.body for r in results]
    assert all(r.json()["size"] == size for r in results)
    assert peak.growth < 60 * MiB, peak.growth >> 20  # was the three bodies and their frames
    r = gw.request("POST", f"/api/sandboxes/{sid}/execute", {"code": (
        "import hashlib, os\nprint(sorted(os.listdir('up')), "
        "{hashlib.sha256(open(f'up/{i}.bin', 'rb').read()).hexdigest() for i in range(3)})")})
    assert r.json()["stdout"] == f"['0.bin', '1.bin', '2.bin'] {{'{hashlib.sha256(data).hexdigest()}'}}\n", r.body
    # A client that goes mid-upload: no file, and no temporary file left behind.
    head = (f"PUT /api/sandboxes/{sid}/files/up/broken.bin HTTP/1.1\r\nHost: x\r\n"
            f"Authorization: token {gw.token}\r\nContent-Length: {size}\r\n")
    s = raw_request(gw, head, data[:8 * MiB])
    wait_for(lambda: any(e["name"].startswith(".sandgate-") and e["name"].endswith(".part") for e in
                         gw.request("GET", f"/api/sandboxes/{sid}/files/up").json()["entries"]), 60)
    s.close()
    wait_for(lambda: [e["name"] for e in gw.request("GET", f"/api/sandboxes/{sid}/files/up").json()["entries"]]
             == ["0.bin", "1.bin", "2.bin"], 60)


def test_websockets_that_do_not_read_go_once_their_output_spends_the_budget(gw, sid):
    """Unsent websocket output is on the budget too. Each of these clients stays
    under its own bound (SANDGATE_CLIENT_BUFFER_MB, 32), together they pass the gateway's."""
    url = f"ws://127.0.0.1:{gw.port}/api/kernels/{sid}/channels?token={gw.token}"
    clients = []
    for _ in range(CLIENTS):
        c = websocket.create_connection(url, timeout=60)
        c.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        clients.append(c)
    try:
        r = gw.request("POST", f"/api/sandboxes/{sid}/execute", {"timeout": 120, "code": (
            "import sys\nfor i in range(28): sys.stdout.write('w' * (1 << 20))\nsys.stdout.flush()")})
        assert r.status == 200, r.body
        wait_for(lambda: _connections(gw, sid) == 0, 60)  # while the budget is spent, this may be a 503
        assert "closing a websocket that stopped reading" in gw.log_text()
        wait_for(lambda: client_bytes(gw) == 0, 30)
    finally:
        for c in clients:
            c.close()


def _connections(gw, sid):
    r = gw.request("GET", f"/api/kernels/{sid}")
    return r.json()["connections"] if r.status == 200 else None


# -- the service's chunked files on the fake driver (tests/core_harness.py): seconds, no sandbox ----------
@run
async def test_an_upload_in_chunks_is_whole_or_absent_and_an_agent_without_chunks_gets_one_write(tmp_path,
                                                                                                   monkeypatch):
    svc = make(tmp_path)
    sb = await start(svc)
    up = svc.upload(sb.id, "d/f.bin")
    for i in range(3):
        assert await up.write(bytes([i]) * 10) is None
    assert await up.write(b"end", last=True) == {"path": "d/f.bin", "size": 33}
    assert await svc.read_file(sb.id, "d/f.bin") == b"\0" * 10 + b"\1" * 10 + b"\2" * 10 + b"end"
    up = svc.upload(sb.id, "d/g.bin")
    await up.write(b"x" * 5)
    listing = [e["name"] for e in (await svc.list_files(sb.id, "d"))["entries"]]
    assert listing[0] == "f.bin" and listing[1].startswith("g.bin.sandgate-") and len(listing) == 2  # not g.bin yet
    await up.abort()
    assert [e["name"] for e in (await svc.list_files(sb.id, "d"))["entries"]] == ["f.bin"]
    # An agent from before chunks (a sandbox restored from an old checkpoint) answers "unknown op".
    monkeypatch.delitem(P.OP_ARGS, "file_write_part")
    up = svc.upload(sb.id, "old.bin")
    await up.write(b"a")
    assert await up.write(b"b", last=True) == {"path": "old.bin", "size": 2}
    assert await svc.read_file(sb.id, "old.bin") == b"ab"
    await svc.delete(sb.id)
