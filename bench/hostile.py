"""The hostile soak: `sandgate bench --hostile`. Every hostile-load attack at once,
each bounded, against one gateway while ordinary sandboxes run cells; the same ordinary load
first on its own (the quiet phase) as the baseline.

Attacks (each a loop of its own until the phase ends; their answers are counted, not judged):
- ``gzip``: E2B file writes whose gzip body (about 1 MB) inflates to 1 GiB of zeros;
- ``heads``: code in two sandboxes sends request heads of up to 150 MiB through the egress proxy, to
  a refused host and to an allowed one (a local upstream counts the bytes that reached it);
- ``half_open``: up to ``HALF_OPEN`` connections that send part of a request line and wait;
- ``tokens``: requests with made-up tenant tokens (``sgt.<name>.<x>``), four at a time;
- ``downloads``: GETs of a 256 MiB workspace file whose clients never read;
- ``websockets``: 20 kernel websockets that never read, on a kernel printing 1 MiB at a time;
- ``execute``: execute calls with 60 MiB bodies, three at a time.

The gateway runs with SANDGATE_GATEWAY_MEMORY_MB=1024, the limit deploy/ ships. Reported: the gateway's RSS (at rest, peak of each phase, the hostile peak over the quiet one), the
ordinary clients' ``print`` round trip p50/p99 in each phase and their ratio, every failure an ordinary
client saw, and each attack's answers. Goals: under +256 MiB, p99 within 3x of quiet, zero
ordinary failures. The bench fails (exit 1) only when it could not run, or the gateway died.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import random
import resource
import socket
import string
import sys
import tempfile
import threading
import time
import zlib
from collections import Counter
from pathlib import Path
from typing import Callable, Dict, List, Optional

from .harness import BenchError, conclude, default_home, preflight, progress, runsc_version
from .targets import SandgateTarget
from .load import connect_all, load

GOAL_RSS_MB = 256
GATEWAY_MEMORY_MB = 1024
GOAL_P99_RATIO = 3.0
HALF_OPEN = 2000  # the bench's own descriptors bound it; a client with more can open ten times as many
UPSTREAM_HOST = "127.0.0.3"  # an allowed egress host on the host's loopback (not the sandbox's)
ALLOWED, REFUSED = "allowed.hostile.test", "refused.hostile.test"
ATTACKS = ("gzip", "heads", "half_open", "tokens", "downloads", "websockets", "execute")


def gzip_bomb(inflated: int = 1 << 30) -> bytes:
    """A gzip member of ``inflated`` zero bytes, made a MiB at a time (about 1 MB)."""
    c = zlib.compressobj(9, zlib.DEFLATED, 31)
    block = bytes(1 << 20)
    parts = [c.compress(block) for _ in range(inflated >> 20)]
    return b"".join(parts) + c.flush()


class Upstream:
    """A TCP server on UPSTREAM_HOST that reads and discards: how many bytes reached it."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((UPSTREAM_HOST, 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.received = 0
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._drain, args=(conn,), daemon=True).start()

    def _drain(self, conn):
        with conn:
            while True:
                try:
                    data = conn.recv(1 << 16)
                except OSError:
                    return
                if not data:
                    return
                self.received += len(data)

    def close(self):
        self.sock.close()


class RSSSampler:
    """The gateway's RSS every 50 ms, in a thread; ``peak()`` since the last ``reset()``."""

    def __init__(self, pid: int):
        import psutil

        self.proc = psutil.Process(pid)
        self._peak = 0
        self.alive = True
        self._stop = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def now(self) -> int:
        return self.proc.memory_info().rss

    def _run(self):
        while not self._stop.wait(0.05):
            try:
                self._peak = max(self._peak, self.now())
            except Exception:  # the gateway is gone
                self.alive = False
                return

    def reset(self) -> None:
        self._peak = self.now()

    def peak(self) -> int:
        return self._peak

    def stop(self) -> None:
        self._stop.set()


class Attacks:
    """Every attack's loop, and what it saw: {attack: Counter of outcomes}."""

    def __init__(self, target: SandgateTarget, victims: Dict[str, str], tenant: str):
        self.t = target
        self.host, self.port = "127.0.0.1", target.port
        self.victims = victims  # role -> sandbox id
        self.tenant = tenant
        self.seen: Dict[str, Counter] = {a: Counter() for a in ATTACKS}
        self.stop = threading.Event()
        self.threads: List[threading.Thread] = []
        self.sockets: List[socket.socket] = []
        # made before the phase: a GiB to compress and 60 MiB to encode are the bench's work, not the attack's
        self.bomb = gzip_bomb()
        self.execute_body = json.dumps({"code": "#" + "x" * (60 << 20) + "\n1", "timeout": 30}).encode()

    def note(self, attack: str, outcome) -> None:
        self.seen[attack][str(outcome)] += 1

    def spawn(self, attack: str, fn: Callable[[], None], n: int = 1) -> None:
        def loop():
            while not self.stop.is_set():
                try:
                    fn()
                except Exception as e:  # noqa: BLE001 - an attack's failure is an outcome, not the bench's
                    self.note(attack, type(e).__name__)
                    self.stop.wait(0.05)
        for _ in range(n):
            th = threading.Thread(target=loop, daemon=True, name=f"attack-{attack}")
            th.start()
            self.threads.append(th)

    # -- plain HTTP on a socket of our own: the status line, without reading a body we asked to hold
    def raw(self, head: bytes, body: bytes = b"", read: bool = True, timeout: float = 60) -> str:
        s = socket.create_connection((self.host, self.port), timeout=timeout)
        try:
            s.sendall(head + body)
            if not read:
                return "sent"
            line = s.makefile("rb").readline()
            return line.split(b" ")[1].decode() if line.count(b" ") >= 1 else "closed"
        finally:
            s.close()

    def request_head(self, method: str, path: str, headers: Dict[str, str], length: int) -> bytes:
        lines = [f"{method} {path} HTTP/1.1", f"Host: {self.host}:{self.port}", f"Content-Length: {length}",
                 "Connection: close", *(f"{k}: {v}" for k, v in headers.items())]
        return ("\r\n".join(lines) + "\r\n\r\n").encode()

    # -- the attacks ------------------------------------------------------------------
    def gzip_loop(self) -> None:
        bomb = self.bomb
        headers = {"X-API-KEY": self.t.token, "E2b-Sandbox-Id": self.victims["files"], "E2b-Sandbox-Port": "49983",
                   "Content-Type": "application/octet-stream", "Content-Encoding": "gzip"}

        def once():
            self.note("gzip", self.raw(self.request_head("POST", "/e2b/files?path=bomb.bin", headers, len(bomb)), bomb))
        self.spawn("gzip", once)

    def half_open_loop(self) -> None:
        def once():
            open_now = [s for s in self.sockets if s.fileno() != -1]
            self.sockets[:] = open_now
            if len(open_now) >= HALF_OPEN:
                # still held? a closed one reads EOF at once
                for s in list(open_now):
                    s.setblocking(False)
                    try:
                        if s.recv(1) == b"":
                            s.close()
                            self.note("half_open", "closed by the gateway")
                    except BlockingIOError:
                        pass
                    except OSError:
                        s.close()
                        self.note("half_open", "reset by the gateway")
                self.stop.wait(0.5)
                return
            try:
                s = socket.create_connection((self.host, self.port), timeout=5)
                s.sendall(b"GET /api HTTP/1.1\r\nHost: x\r\n")  # and nothing more
                self.sockets.append(s)
                self.note("half_open", "opened")
            except OSError as e:
                self.note("half_open", f"connect: {e.strerror or type(e).__name__}")
                self.stop.wait(0.1)
        self.spawn("half_open", once)

    def tokens_loop(self) -> None:
        def once():
            x = "".join(random.choices(string.ascii_letters + string.digits, k=32))
            name = random.choice([self.tenant, "nobody-" + x[:6]])
            head = (f"GET /api/sandboxes HTTP/1.1\r\nHost: x\r\nAuthorization: token sgt.{name}.{x}\r\n"
                    "Connection: close\r\n\r\n").encode()
            self.note("tokens", self.raw(head))
        self.spawn("tokens", once, n=4)

    def downloads_loop(self) -> None:
        sid = self.victims["files"]

        def once():
            s = socket.create_connection((self.host, self.port), timeout=60)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.sendall(f"GET /api/sandboxes/{sid}/files/big.bin HTTP/1.1\r\nHost: x\r\n"
                      f"Authorization: token {self.t.token}\r\n\r\n".encode())
            self.note("downloads", "held")
            self.stop.wait()  # never read; closed when the phase ends
            s.close()
        self.spawn("downloads", once, n=4)

    def websockets_loop(self) -> None:
        import websocket

        kid = self.victims["chatty"]
        held = []

        def once():
            if len(held) >= 20:
                self.stop.wait()
                for ws in held:
                    try:
                        ws.close()
                    except Exception:  # noqa: BLE001 - a dropped one is closed already
                        pass
                return
            ws = websocket.create_connection(
                f"ws://{self.host}:{self.port}/api/kernels/{kid}/channels?session_id=stall{len(held)}",
                header=[f"Authorization: token {self.t.token}"], timeout=30)
            ws.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            held.append(ws)
            self.note("websockets", "connected")
        self.spawn("websockets", once)

    def execute_loop(self) -> None:
        sid = self.victims["files"]
        body = self.execute_body
        head = self.request_head("POST", f"/api/sandboxes/{sid}/execute",
                                 {"Authorization": f"token {self.t.token}", "Content-Type": "application/json"},
                                 len(body))

        def once():
            self.note("execute", self.raw(head, body, timeout=120))
        self.spawn("execute", once, n=3)

    def heads(self, upstream: Upstream, seconds: float) -> None:
        """A cell in each head sandbox that sends huge heads through its proxy until ``seconds`` pass."""
        code = HEADS_CELL.format(seconds=seconds, refused=REFUSED, allowed=ALLOWED, port=upstream.port)

        def run(sid):
            try:
                ex = self.t.handle(sid).run_code(code, timeout=seconds + 120)
                for line in (ex.stdout or "").splitlines():
                    if line.startswith("outcome "):
                        self.note("heads", line[len("outcome "):])
                if ex.status != "ok":
                    self.note("heads", f"cell {ex.status}")
            except Exception as e:  # noqa: BLE001
                self.note("heads", f"cell: {type(e).__name__}")
        for role in ("heads1", "heads2"):
            th = threading.Thread(target=run, args=(self.victims[role],), daemon=True, name="attack-heads")
            th.start()
            self.threads.append(th)

    def start(self, upstream: Upstream, seconds: float, only=ATTACKS) -> None:
        loops = {"gzip": self.gzip_loop, "half_open": self.half_open_loop, "tokens": self.tokens_loop,
                 "downloads": self.downloads_loop, "websockets": self.websockets_loop, "execute": self.execute_loop,
                 "heads": lambda: self.heads(upstream, seconds)}
        for attack in only:
            loops[attack]()

    def end(self) -> None:
        self.stop.set()
        for s in self.sockets:
            s.close()
        for th in self.threads:
            th.join(150)


# Runs inside a sandbox: huge heads through the egress proxy (HTTP_PROXY), each connection until it is
# cut or 150 MiB are sent; then what it saw, as lines the bench counts.
HEADS_CELL = '''
import os, socket, time, collections
proxy = os.environ["HTTP_PROXY"].split("//")[-1].rstrip("/")
host, port = proxy.rsplit(":", 1)
seen = collections.Counter()
chunk = b"a" * (1 << 20)
end = time.monotonic() + {seconds}
n = 0
while time.monotonic() < end:
    target = "{refused}" if n % 2 == 0 else "{allowed}:{port}"
    n += 1
    s = socket.create_connection((host, int(port)), timeout=30)
    try:
        s.sendall(("GET http://%s/ HTTP/1.1\\r\\nHost: %s\\r\\nX-Big: " % (target, target)).encode())
        sent = 0
        while sent < (150 << 20) and time.monotonic() < end:
            s.sendall(chunk)
            sent += len(chunk)
        s.sendall(b"\\r\\n\\r\\n")
        line = s.makefile("rb").readline()
        seen[("refused " if n % 2 else "allowed ") + (line.split(b" ")[1].decode() if b" " in line else "closed")] += 1
    except OSError as e:
        seen[("refused " if n % 2 else "allowed ") + "cut: " + (e.strerror or type(e).__name__)] += 1
    finally:
        s.close()
for k, v in seen.items():
    for _ in range(v):
        print("outcome", k)
'''


class Chatty:
    """A websocket that runs a cell printing 1 MiB at a time for ``seconds`` and reads (and drops) it all."""

    def __init__(self, target: SandgateTarget, kid: str, seconds: float):
        import websocket

        self.ws = websocket.create_connection(
            f"ws://127.0.0.1:{target.port}/api/kernels/{kid}/channels?session_id=chatty",
            header=[f"Authorization: token {target.token}"], timeout=30)
        self.code = (f"import sys, time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end:\n"
                     "    sys.stdout.write('z' * (1 << 20)); sys.stdout.flush()")
        self.thread = threading.Thread(target=self._read, daemon=True, name="attack-chatty")

    def start(self) -> None:
        import uuid

        msg_id = uuid.uuid4().hex
        self.ws.send(json.dumps({
            "header": {"msg_id": msg_id, "msg_type": "execute_request", "session": "chatty", "username": "",
                       "version": "5.3", "date": dt.datetime.now(dt.timezone.utc).isoformat()},
            "parent_header": {}, "metadata": {}, "channel": "shell",
            "content": {"code": self.code, "silent": False, "store_history": False, "user_expressions": {},
                        "allow_stdin": False}}))
        self.thread.start()

    def _read(self) -> None:
        try:
            while True:
                self.ws.recv()
        except Exception:  # noqa: BLE001 - closed at the end, or dropped: either way done
            return

    def close(self) -> None:
        try:
            self.ws.close()
        except Exception:  # noqa: BLE001
            pass


def ordinary_phase(kernels: list, seconds: float, sampler: RSSSampler, gw_pid: int, name: str) -> dict:
    sampler.reset()
    progress(f"{name}: {len(kernels)} ordinary sandboxes running cells for {seconds:g} s")
    r = load(kernels, seconds, gateway_pid=gw_pid)
    r["peak_rss_mb"] = sampler.peak() / 2**20
    progress(f"{name}: {r['cells']} cells, p50 {r.get('p50_ms', 0):.1f} ms, p99 {r.get('p99_ms', 0):.1f} ms, "
             f"failures {r['failures']}, peak RSS {r['peak_rss_mb']:.0f} MiB" + "".join(f"\n  {e}" for e in r["errors"]))
    return r


def alive(target: SandgateTarget) -> bool:
    try:
        return target.request("GET", "/api", timeout=30)[0] == 200
    except Exception:  # noqa: BLE001 - dead or not answering: the same verdict
        return False


def run(args) -> int:
    seconds, n = args.hostile_seconds, args.hostile_sandboxes
    only = tuple(a for a in (args.hostile_attacks or ",".join(ATTACKS)).split(",") if a)
    if seconds <= 0 or n < 1 or not only or set(only) - set(ATTACKS):
        print("sandgate bench: --hostile-seconds must be above 0, --hostile-sandboxes at least 1 and "
              f"--hostile-attacks some of {','.join(ATTACKS)}", file=sys.stderr)
        return 2
    home = Path(args.home) if args.home else default_home()
    logdir = Path(tempfile.mkdtemp(prefix="sandgate-bench-hostile-"))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, HALF_OPEN * 2 + 1024)), hard))
    upstream = Upstream()
    target = SandgateTarget(logdir, home, "sandgate-hostile", {
        "SANDGATE_MAX_KERNELS": str(n + 8), "SANDGATE_KEEP_SANDBOXES": "false",
        "SANDGATE_TENANT_MAX_SANDBOXES": "0", "SANDGATE_TENANT_MAX_MEMORY_MB": "0", "SANDGATE_TENANT_CREATE_RATE": "0",
        "SANDGATE_EGRESS_HOSTS": f"{ALLOWED}={UPSTREAM_HOST}",
        # the limit deploy/systemd and deploy/k8s ship: past it the gateway dies, and the bench says so
        "SANDGATE_GATEWAY_MEMORY_MB": str(GATEWAY_MEMORY_MB)})
    report: Dict[str, object] = {}
    failed: Optional[str] = None
    sampler = None
    attacks = None
    chatty = None
    try:
        preflight(home)
        progress(f"starting {target.name} on port {target.port} (log {target.log_path})")
        target.setup()
        sampler = RSSSampler(target.proc.pid)
        ids = []
        for i in range(n):
            ids.append(target.create_sandbox())
        progress(f"{n} ordinary sandboxes up")
        egress = {"allow": [ALLOWED]}
        victims = {"files": target.create_sandbox(), "chatty": target.create_sandbox(),
                   "heads1": target.create_sandbox(egress=egress), "heads2": target.create_sandbox(egress=egress)}
        target.run_cell(victims["files"], "open('/workspace/big.bin', 'wb').truncate(256 << 20)")
        progress("attack sandboxes up: files, chatty, heads1, heads2")
        status, body = target.request("POST", "/api/tenants", {"name": "hostile-bench"})
        if status != 201:
            raise BenchError(f"{target.name}: could not make a tenant: {status} {body}")
        kernels = connect_all(target, ids)
        rest_mb = sampler.now() / 2**20
        attacks = Attacks(target, victims, "hostile-bench")
        quiet = ordinary_phase(kernels, seconds, sampler, target.proc.pid, "quiet")
        if "websockets" in only:  # the chatty kernel prints for the whole phase; one reader takes it all
            chatty = Chatty(target, victims["chatty"], seconds + 10)
            chatty.start()
        attacks.start(upstream, seconds, only)
        hostile = ordinary_phase(kernels, seconds, sampler, target.proc.pid, "hostile")
        attacks.end()
        if chatty:
            chatty.close()
        is_alive = sampler.alive and target.proc.poll() is None and alive(target)
        growth = hostile["peak_rss_mb"] - quiet["peak_rss_mb"]
        p99_ratio = (hostile["p99_ms"] / quiet["p99_ms"]) if quiet.get("p99_ms") and hostile.get("p99_ms") else None
        report = {
            "timestamp": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "host": {"cpu_count": os.cpu_count(), "python": platform.python_version(),
                     "platform": platform.platform(), "runsc": runsc_version()},
            "seconds": seconds, "ordinary_sandboxes": n, "only": list(only), "rest_rss_mb": rest_mb,
            "quiet": quiet, "hostile": hostile, "rss_growth_mb": growth, "p99_ratio": p99_ratio,
            "gateway_alive": is_alive, "upstream_bytes": upstream.received,
            "attacks": {a: dict(c) for a, c in attacks.seen.items()},
            "goals": {"rss_growth_mb": {"goal": GOAL_RSS_MB, "met": growth < GOAL_RSS_MB},
                      "p99_ratio": {"goal": GOAL_P99_RATIO, "met": p99_ratio is not None and p99_ratio <= GOAL_P99_RATIO},
                      "ordinary_failures": {"goal": 0, "met": hostile["failures"] == 0 and quiet["failures"] == 0}},
        }
        if not is_alive:
            failed = f"the gateway died or stopped answering under the attacks (log {target.log_path})"
            Path(args.output).write_text(json.dumps(report, indent=1))
    except KeyboardInterrupt:
        failed = "interrupted"
    except BenchError as e:
        failed = str(e)
    finally:
        if attacks:
            attacks.end()
        if chatty:
            chatty.close()
        if sampler:
            sampler.stop()
        upstream.close()
        target.teardown()
    return conclude(failed, logdir, args.output, report, table)


def table(r: dict) -> str:
    q, h = r["quiet"], r["hostile"]
    g = r["goals"]

    def met(key):
        return "met" if g[key]["met"] else "NOT met"
    out = [f"| {r['ordinary_sandboxes']} ordinary sandboxes x {r['seconds']:g} s ({r['host']['cpu_count']} CPUs) "
           "| quiet | hostile | goal |", "| --- | ---: | ---: | --- |",
           f"| gateway RSS peak (MiB; {r['rest_rss_mb']:.0f} at rest) | {q['peak_rss_mb']:.0f} | {h['peak_rss_mb']:.0f} "
           f"| +{r['rss_growth_mb']:.0f} MiB, under +{GOAL_RSS_MB}: {met('rss_growth_mb')} |",
           f"| ordinary round trip p50 (ms) | {q.get('p50_ms', 0):.1f} | {h.get('p50_ms', 0):.1f} | |",
           f"| ordinary round trip p99 (ms) | {q.get('p99_ms', 0):.1f} | {h.get('p99_ms', 0):.1f} "
           f"| {r['p99_ratio'] or 0:.2f}x, within {GOAL_P99_RATIO:g}x: {met('p99_ratio')} |",
           f"| ordinary cells | {q['cells']} | {h['cells']} | |",
           f"| ordinary failures | {q['failures']} | {h['failures']} | 0: {met('ordinary_failures')} |",
           "", "| attack | answers |", "| --- | --- |"]
    for a in ATTACKS:
        seen = r["attacks"].get(a) or {}
        out.append(f"| {a} | " + (", ".join(f"{k} x{v}" for k, v in sorted(seen.items())) or "-") + " |")
    out.append(f"\nbytes of oversized heads that reached the allowed upstream: {r['upstream_bytes']}")
    errors = h["errors"] + q["errors"]
    if errors:
        out.append("ordinary failures:\n" + "\n".join(f"  {e}" for e in errors))
    return "\n".join(out)
