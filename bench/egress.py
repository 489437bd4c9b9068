"""`sandgate bench --egress`: the egress proxy beside direct connections, and the 1+1 round trip with
egress on and off.

Everything stays on loopback. The bench starts, in processes of its own:

* the upstream: an HTTP server on 127.0.0.3 and an HTTPS server on 127.0.0.4 (a certificate for
  ``secure.test`` from a CA made for the run), both answering ``GET /<n>`` with n bytes, HTTP/1.1
  keep-alive, TCP_NODELAY, a thread per connection;
* a host client (``egress_client.py`` run as a script, stdlib only);
* a host proxy: an ``EgressProxy`` (the gateway's class: mitmproxy in an asyncio loop) behind a local
  listener that hands each connection to ``open()``, as tests/test_egress_proxy.py does: the proxy
  without the sandbox tunnel;
* ``sandgate serve`` (gVisor, warm start off) with ``SANDGATE_EGRESS_HOSTS`` naming the two servers
  and ``SANDGATE_EGRESS_CA_BUNDLE`` the run's CA, and four sandboxes in it: two created with an egress
  policy allowing the two servers, two without, in the order off, on, on, off.

Part 1, three locations side by side, interleaved (each measurement is run at the three locations back
to back, in an order that rotates, and the whole set ``ROUNDS`` times):

* ``host-direct``: the host client straight to the servers (the baseline);
* ``host-proxy``: the host client through the host proxy (mitmproxy's cost alone);
* ``sandbox-proxy``: the same client code executed in the egress sandbox's kernel, through its
  HTTP(S)_PROXY: agent listener, tunnel frames over the agent's stream, the gateway, mitmproxy, upstream.

For plain HTTP (absolute-form requests) and HTTPS (CONNECT, then TLS terminated by the proxy and made
again upstream), ``CELLS``: 1 KiB responses over 1 and 16 kept-alive connections (latency p50/p99,
requests/s), 1 MiB responses over 1 and 16 (MB/s, 10^6 bytes), and a new connection per 1 KiB request
(the handshakes). Each measurement runs ``seconds`` after its connections are warm. Figures pool the
rounds; the ratio columns are the median over rounds of the ratio within a round (its three
measurements ran back to back, so they saw the same load).

Where the time goes: CPU time per request, read around each measurement (psutil): the host client; the
host proxy's process; for the sandbox, the runsc processes (the client and the agent's end of the
tunnel, under gVisor), the shim (drivers/shim.py, which copies the agent's stream between runsc's
stdio and the gateway's socket), and the gateway's own process (its end of the tunnel and mitmproxy);
and, inside the sandbox, the client's kernel and the agent as gVisor counts them (from its /proc: only
the split between the two means something; under load those counts exceed the host's).

Part 2: the ``1+1`` round trip over the Jupyter websocket on the four sandboxes, ``runs`` each after 5
warmup runs, one execute per sandbox in turn (the order rotating); p50/p99 per kind (egress on / off,
each pooling its two sandboxes) and their ratio (on/off, ~1 is no regression), and each sandbox's own.
Run first, before any egress traffic.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import http.server
import json
import os
import platform
import select
import shutil
import signal
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

from .harness import (WARMUP, BenchError, cell_result, default_home, need_psutil, percentile, progress, runsc_version,
                      tree_processes)
from .targets import SDKKernel, SandgateTarget

PLAIN_IP, TLS_IP = "127.0.0.3", "127.0.0.4"  # loopback only
PLAIN_NAME, TLS_NAME = "plain.test", "secure.test"
CLIENT = Path(__file__).with_name("egress_client.py")
HOST_SID = "bench-host"  # the host proxy's one "sandbox"
ROUNDS = 3
SECONDS = 2.0
SMALL, LARGE = 1024, 1 << 20
SCHEMES = ("http", "https")
LOCATIONS = ("host-direct", "host-proxy", "sandbox-proxy")
CELLS = [  # key, label, response bytes, connections, mode
    ("small_c1", "1 KiB, 1 connection", SMALL, 1, "keep"),
    ("small_c16", "1 KiB, 16 connections", SMALL, 16, "keep"),
    ("large_c1", "1 MiB, 1 connection", LARGE, 1, "keep"),
    ("large_c16", "1 MiB, 16 connections", LARGE, 16, "keep"),
    ("new_c1", "1 KiB, new connection each", SMALL, 1, "new"),
]
HELPER_TIMEOUT = 60.0
SANDBOXES = ("egress_off-1", "egress_on-1", "egress_on-2", "egress_off-2")  # in creation order


# -- the run's CA and the upstream servers (a process of their own) -------------------------------

def make_ca(tmp: Path):
    """A CA and a leaf for secure.test, as files (ca.pem, leaf.pem with its key)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    name = lambda cn: x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])
    now = dt.datetime.now(dt.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(name("sandgate bench CA")).issuer_name(name("sandgate bench CA"))
          .public_key(ca_key.public_key()).serial_number(1).not_valid_before(now - dt.timedelta(days=1))
          .not_valid_after(now + dt.timedelta(days=2))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    leaf = (x509.CertificateBuilder().subject_name(name(TLS_NAME)).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(2).not_valid_before(now - dt.timedelta(days=1))
            .not_valid_after(now + dt.timedelta(days=2))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(TLS_NAME)]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    (tmp / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (tmp / "leaf.pem").write_bytes(leaf.public_bytes(serialization.Encoding.PEM) + key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return tmp / "ca.pem", tmp / "leaf.pem"


BODY = bytes(range(256)) * (LARGE // 256)


class Bytes(http.server.BaseHTTPRequestHandler):
    """GET /<n>: n bytes (at most 1 MiB), kept alive."""

    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body are two writes: no delayed-ACK stall between them

    def do_GET(self):
        try:
            n = int(self.path.rsplit("/", 1)[-1])
        except ValueError:
            n = -1
        if not 0 <= n <= len(BODY):
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(n))
        self.end_headers()
        self.wfile.write(memoryview(BODY)[:n])

    def log_message(self, *args):
        pass


class Server(http.server.ThreadingHTTPServer):
    request_queue_size = 128
    daemon_threads = True
    tls: Optional[ssl.SSLContext] = None

    def finish_request(self, request, client_address):
        # The TLS handshake in the connection's thread, not in the accepting one.
        if self.tls is not None:
            try:
                request = self.tls.wrap_socket(request, server_side=True)
            except (ssl.SSLError, OSError):
                return
        try:
            super().finish_request(request, client_address)
        finally:
            if self.tls is not None:
                request.close()


def serve_upstream(leaf: str) -> None:
    plain = Server((PLAIN_IP, 0), Bytes)
    tls = Server((TLS_IP, 0), Bytes)
    tls.tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.tls.load_cert_chain(leaf)
    for s in (plain, tls):
        threading.Thread(target=s.serve_forever, daemon=True).start()
    print(json.dumps({"http": plain.server_address[1], "https": tls.server_address[1]}), flush=True)
    sys.stdin.read()  # until the bench closes our stdin


# -- the host proxy: EgressProxy behind a local listener (no sandbox, no tunnel) -----------------

def serve_proxy(home: str, ca: str, hosts: str, allow: str) -> None:
    from sandgate.egress.policy import EgressPolicy
    from sandgate.egress.proxy import EgressProxy, table_resolver

    async def pipe(reader, writer):
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def main():
        table = dict(kv.split("=", 1) for kv in hosts.split(","))
        proxy = EgressProxy(Path(home), upstream_ca_bundle=Path(ca), resolver=table_resolver(table))
        await proxy.start()
        proxy.set_policy(HOST_SID, EgressPolicy(allow=json.loads(allow)), [], {})

        async def bridge(reader, writer):
            try:
                up_reader, up_writer = await proxy.open(HOST_SID)
            except OSError:
                writer.close()
                return
            await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

        server = await asyncio.start_server(bridge, "127.0.0.1", 0)
        ca_file = Path(home) / "proxy-ca.pem"
        ca_file.write_bytes(proxy.ca_certificate_pem())
        print(json.dumps({"url": f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", "ca": str(ca_file)}),
              flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        server.close()
        await proxy.stop()

    asyncio.run(main())


# -- helper processes --------------------------------------------------------------------------

class Helper:
    """A subprocess that talks one JSON line at a time on stdin/stdout; stderr goes to a log."""

    def __init__(self, name: str, argv: List[str], logdir: Path):
        self.name = name
        self.log_path = logdir / f"{name}.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     start_new_session=True)
        self._buf = b""
        self.ps = need_psutil().Process(self.proc.pid)

    def read(self, timeout: float = HELPER_TIMEOUT) -> dict:
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BenchError(f"{self.name}: no answer within {timeout:g} s (log {self.log_path})")
            if select.select([fd], [], [], left)[0]:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    self._log.flush()
                    raise BenchError(f"{self.name} exited ({self.proc.poll()}):\n"
                                     f"{self.log_path.read_text(errors='replace')[-2000:]}")
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def call(self, msg: dict, timeout: float) -> dict:
        self.proc.stdin.write(json.dumps(msg).encode() + b"\n")
        self.proc.stdin.flush()
        return self.read(timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()  # each helper exits when its stdin closes
                self.proc.wait(15)
            except (OSError, subprocess.TimeoutExpired):
                progress(f"warning: {self.name} did not exit; killing it")
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


def cpu_seconds(procs) -> float:
    """User + system CPU of these processes and their descendants, now."""
    psutil = need_psutil()
    total = 0.0
    for q in tree_processes(procs):
        try:
            c = q.cpu_times()
            total += c.user + c.system
        except psutil.Error:
            pass
    return total


def own_cpu_seconds(p) -> float:
    c = p.cpu_times()
    return c.user + c.system


# CPU as the sandbox's kernel (gVisor's sentry) counts it, per process: the kernel running the client
# (this process), the agent (which carries the client's connections out), anything else.
INSIDE_CPU = """
import os as _os
def _sg_cpu():
    out = {}
    for pid in _os.listdir('/proc'):
        if not pid.isdigit():
            continue
        try:
            with open(f'/proc/{pid}/stat') as f:
                fields = f.read().rsplit(')', 1)[1].split()
            with open(f'/proc/{pid}/cmdline', 'rb') as f:
                cmd = f.read()
        except OSError:
            continue
        who = 'kernel' if int(pid) == _os.getpid() else 'agent' if b'sandgate_agent.agent' in cmd else 'other'
        out[pid] = (who, (int(fields[11]) + int(fields[12])) / _os.sysconf('SC_CLK_TCK'))
    return out
def _sg_cpu_delta(before):
    d = {'kernel': 0.0, 'agent': 0.0, 'other': 0.0}
    for pid, (who, s) in _sg_cpu().items():
        d[who] += s - before.get(pid, (who, 0.0))[1]
    return d
"""


# -- summaries and tables --------------------------------------------------------------------------

def stats(runs: List[dict]) -> Dict[str, Optional[float]]:
    lat = [x for r in runs for x in r["latency_ms"]]
    n = len(lat)
    elapsed = sum(r["elapsed_s"] for r in runs)
    out: Dict[str, Optional[float]] = {
        "n": n, "p50_ms": percentile(lat, 50) if lat else None, "p99_ms": percentile(lat, 99) if lat else None,
        "req_s": n / elapsed if elapsed else None, "mb_s": sum(r["bytes"] for r in runs) / elapsed / 1e6
        if elapsed else None}
    for part in sorted({p for r in runs for p in r["cpu"]}):
        vals = [r["cpu"][part] for r in runs if r["cpu"].get(part) is not None]
        out[f"{part}_cpu_ms_per_req"] = sum(vals) / n * 1e3 if vals and n else None
    return out


PAIRS = [("host-proxy", "host-direct"), ("sandbox-proxy", "host-direct"), ("sandbox-proxy", "host-proxy")]
FIGURES = ("p50_ms", "p99_ms", "req_s", "mb_s")


def round_ratios(by_loc: Dict[str, List[dict]]) -> Dict[str, Dict[str, Optional[float]]]:
    """For each figure and pair of locations, the median over rounds of the ratio within a round (the
    measurements of one round ran back to back, so they saw the same load)."""
    rounds = min(len(rs) for rs in by_loc.values())
    per = [{loc: stats([rs[i]]) for loc, rs in by_loc.items()} for i in range(rounds)]
    out: Dict[str, Dict[str, Optional[float]]] = {}
    for a, b in PAIRS:
        out[f"{a}/{b}"] = {}
        for fig in FIGURES:
            xs = [r[a][fig] / r[b][fig] for r in per if r[a][fig] is not None and r[b][fig]]
            out[f"{a}/{b}"][fig] = statistics.median(xs) if xs else None
    return out


ROWS = {  # which figures a cell's table shows
    "small_c1": [("p50_ms", "p50 (ms)", "{:.2f}"), ("p99_ms", "p99 (ms)", "{:.2f}"), ("req_s", "requests/s", "{:.0f}")],
    "small_c16": [("p50_ms", "p50 (ms)", "{:.2f}"), ("p99_ms", "p99 (ms)", "{:.2f}"), ("req_s", "requests/s", "{:.0f}")],
    "large_c1": [("p50_ms", "p50 (ms)", "{:.1f}"), ("mb_s", "MB/s", "{:.0f}")],
    "large_c16": [("p50_ms", "p50 (ms)", "{:.1f}"), ("mb_s", "MB/s", "{:.0f}")],
    "new_c1": [("p50_ms", "p50 (ms)", "{:.2f}"), ("p99_ms", "p99 (ms)", "{:.2f}"), ("req_s", "requests/s", "{:.0f}")],
}
CPU_COLUMNS = [  # location, part, column
    ("host-direct", "client", "direct: client"),
    ("host-proxy", "client", "host-proxy: client"),
    ("host-proxy", "proxy", "host-proxy: proxy"),
    ("sandbox-proxy", "runsc", "sandbox: runsc"),
    ("sandbox-proxy", "kernel_inside", "in it: client"),
    ("sandbox-proxy", "agent_inside", "in it: agent"),
    ("sandbox-proxy", "shim", "sandbox: shim"),
    ("sandbox-proxy", "proxy", "sandbox: gateway"),
]


def markdown(head: List[str], rows: List[List[str]]) -> str:
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
    line = lambda r: "| " + " | ".join(c.ljust(w) if i == 0 else c.rjust(w)
                                       for i, (c, w) in enumerate(zip(r, widths))) + " |"
    sep = "|" + "|".join("-" * (w + 2) if i == 0 else "-" * (w + 1) + ":" for i, w in enumerate(widths)) + "|"
    return "\n".join([line(head), sep] + [line(r) for r in rows])


def fmt_ratio(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.2f}x"


def egress_tables(summary: dict, ratios: dict) -> str:
    out = []
    for scheme in SCHEMES:
        head = [f"{scheme.upper()}"] + list(LOCATIONS) + ["proxy/direct", "sandbox/direct", "sandbox/proxy"]
        rows = []
        for key, label, _, _, _ in CELLS:
            for fig, name, fmt in ROWS[key]:
                v = {loc: summary[scheme][key][loc].get(fig) for loc in LOCATIONS}
                rows.append([f"{label}: {name}"] + ["-" if v[loc] is None else fmt.format(v[loc]) for loc in LOCATIONS]
                            + [fmt_ratio(ratios[scheme][key][f"{a}/{b}"][fig]) for a, b in PAIRS])
        out.append(markdown(head, rows))
        head = [f"{scheme.upper()}: CPU ms per request"] + [c for _, _, c in CPU_COLUMNS]
        rows = []
        for key, label, _, _, _ in CELLS:
            v = [summary[scheme][key][loc].get(f"{part}_cpu_ms_per_req") for loc, part, _ in CPU_COLUMNS]
            rows.append([label] + ["-" if x is None else f"{x:.2f}" for x in v])
        out.append(markdown(head, rows))
    return "\n\n".join(out)


def roundtrip_table(rt: dict) -> str:
    head = ["1+1 round trip (ms)", "egress off", "egress on", "on/off"]
    rows = [[q, f"{rt['egress_off'][k]:.2f}", f"{rt['egress_on'][k]:.2f}", f"{rt['ratio_' + k[:3]]:.2f}x"]
            for q, k in (("p50", "p50_ms"), ("p99", "p99_ms"))]
    each = ", ".join(f"{name} {rt[name]['p50_ms']:.2f}" for name in SANDBOXES)
    return markdown(head, rows) + f"\n\np50 per sandbox, in creation order (ms): {each}"


# -- the run ----------------------------------------------------------------------------------------

def run(args) -> int:
    home = Path(args.home) if args.home else default_home()
    seconds = args.egress_seconds if getattr(args, "egress_seconds", None) else SECONDS
    runs = max(1, args.runs)
    from sandgate_images import rootfs

    try:
        need_psutil()
        rootfs.build(home)
    except (BenchError, RuntimeError) as e:
        print(f"sandgate bench: {e}", file=sys.stderr)
        return 1

    def on_term(signum, frame):
        raise KeyboardInterrupt

    old_term = signal.signal(signal.SIGTERM, on_term)
    logdir = Path(tempfile.mkdtemp(prefix="sandgate-bench-egress-"))
    helpers: List[Helper] = []
    t: Optional[SandgateTarget] = None
    kernels: List[SDKKernel] = []
    raw: Dict[str, Dict[str, Dict[str, List[dict]]]] = {
        s: {c[0]: {loc: [] for loc in LOCATIONS} for c in CELLS} for s in SCHEMES}
    rt_raw: Dict[str, List[float]] = {"egress_off": [], "egress_on": []}
    rt_each: Dict[str, List[float]] = {name: [] for name in SANDBOXES}
    boot: Dict[str, List[float]] = {"egress_off": [], "egress_on": []}
    failed = None
    t_start = time.monotonic()
    try:
        progress(f"upstream servers on {PLAIN_IP} (HTTP) and {TLS_IP} (HTTPS, a CA made for this run); "
                 f"logs in {logdir}")
        ca, leaf = make_ca(logdir)
        up = Helper("upstream", [sys.executable, "-m", "sandgate_bench.egress", "upstream", str(leaf)], logdir)
        helpers.append(up)
        ports = up.read()
        hosts = f"{PLAIN_NAME}={PLAIN_IP},{TLS_NAME}={TLS_IP}"
        allow = [f"{TLS_NAME}:{ports['https']}", f"{PLAIN_NAME}:{ports['http']}", f"{PLAIN_IP}/32", f"{TLS_IP}/32"]
        (logdir / "proxy-home").mkdir()
        hp = Helper("host-proxy", [sys.executable, "-m", "sandgate_bench.egress", "proxy", str(logdir / "proxy-home"),
                                   str(ca), hosts, json.dumps(allow)], logdir)
        helpers.append(hp)
        host_proxy = hp.read()
        client = Helper("host-client", [sys.executable, str(CLIENT)], logdir)
        helpers.append(client)

        t = SandgateTarget(logdir, home, "sandgate-egress", {
            "SANDGATE_WARM_START": "false", "SANDGATE_KEEP_SANDBOXES": "false",
            "SANDGATE_EGRESS_HOSTS": hosts, "SANDGATE_EGRESS_CA_BUNDLE": str(ca)})
        progress(f"starting a gateway on port {t.port} (gVisor, warm start off; log {t.log_path})")
        t.setup()
        # Two sandboxes with a policy and two without, created off, on, on, off: a sandbox's place in
        # the creation order showed in its round trip by a few percent, so the order is balanced.
        sids: Dict[str, str] = {}
        for name in SANDBOXES:
            which = name.rsplit("-", 1)[0]
            t0 = time.perf_counter()
            sid = t.create_sandbox(**({"egress": {"allow": allow}} if which == "egress_on" else {}))
            if cell_result(t.run_cell(sid, "1+1")) != "2":
                raise BenchError(f"1+1 in sandbox {sid} did not give 2")
            boot[which].append(time.perf_counter() - t0)
            t.runtime_id(sid)
            sids[name] = sid
            progress(f"sandbox {sid} ({name}) answered 1+1 {boot[which][-1]:.1f} s after create")

        # Part 2 first: the round trip before any egress traffic.
        progress(f"1+1 round trips on the {len(sids)} sandboxes: {runs} each after {WARMUP} warmup, in turn")
        ks = {name: t.connect(sid) for name, sid in sids.items()}
        kernels.extend(ks.values())
        for k in ks.values():
            for _ in range(WARMUP):
                k.execute("1+1")
        order = list(ks)
        for i in range(runs):
            for name in order[i % len(order):] + order[:i % len(order)]:  # drift hits every sandbox alike
                t0 = time.perf_counter()
                ks[name].execute("1+1")
                rt_raw[name.rsplit("-", 1)[0]].append(time.perf_counter() - t0)
                rt_each[name].append(time.perf_counter() - t0)
            if (i + 1) % 100 == 0 and i + 1 < runs:
                progress(f"1+1 round trips {i + 1}/{runs}")
        progress("1+1 p50: " + ", ".join(f"{name} {percentile(v, 50) * 1e3:.2f} ms" for name, v in rt_each.items()))
        for k in kernels:
            k.close()
        kernels.clear()

        on = sids[SANDBOXES[1]]  # part 1 runs in the first sandbox with a policy
        env = t.run_cell(on, "import os; print(os.environ.get('HTTPS_PROXY'), os.environ.get('HTTP_PROXY'))")
        if "None" in env.stdout:
            raise BenchError(f"the egress sandbox has no proxy in its environment: {env.stdout!r}")
        t.run_cell(on, f"_sgc = {{'__name__': 'sandgate_bench_client'}}\nexec({CLIENT.read_text()!r}, _sgc)\n"
                       + INSIDE_CPU)

        # Part 1.
        shims = t.kernel_procs(on)  # the gateway's child for this sandbox: the shim; runsc runs under it
        if not shims:
            raise BenchError(f"no process of sandbox {on} found under the gateway")
        gateway = t.ps

        def runsc_procs():
            psutil = need_psutil()
            try:
                return [c for p in shims for c in p.children()]
            except psutil.Error:
                return []

        def cpu_now(loc: str) -> Dict[str, float]:
            c = {"upstream": cpu_seconds([up.ps])}
            if loc == "sandbox-proxy":
                c.update(runsc=cpu_seconds(runsc_procs()), shim=sum(own_cpu_seconds(p) for p in shims),
                         proxy=own_cpu_seconds(gateway))
            else:
                c["client"] = cpu_seconds([client.ps])
                if loc == "host-proxy":
                    c["proxy"] = own_cpu_seconds(hp.ps)
            return c

        def measure(loc: str, cfg: dict) -> dict:
            cfg = dict(cfg)
            if loc == "host-direct":
                cfg.update(address=PLAIN_IP if cfg["scheme"] == "http" else TLS_IP,
                           cafile=str(ca) if cfg["scheme"] == "https" else None)
            elif loc == "host-proxy":
                cfg.update(proxy=host_proxy["url"], cafile=host_proxy["ca"] if cfg["scheme"] == "https" else None)
            else:
                cfg.update(proxy="env")
            before = cpu_now(loc)
            if loc == "sandbox-proxy":
                out = t.run_cell(on, f"import json as _j\n_c0 = _sg_cpu()\n"
                                     f"_r = _sgc['measure'](_j.loads({json.dumps(cfg)!r}))\n"
                                     f"_r['inside'] = _sg_cpu_delta(_c0)\nprint(_j.dumps(_r))")
                r = json.loads(out.stdout.strip().splitlines()[-1])  # the result is the cell's last line
            else:
                r = client.call(cfg, timeout=cfg["duration"] + HELPER_TIMEOUT)
            after = cpu_now(loc)
            if r.get("error") or r.get("error_count") or not r.get("n"):
                raise BenchError(f"{loc} {cfg['scheme']} {cfg['path']} x{cfg['conc']}: "
                                 f"{r.get('error') or r.get('errors') or 'no request completed'}")
            if r["bytes"] != r["n"] * cfg["size"]:
                raise BenchError(f"{loc}: {r['bytes']} bytes for {r['n']} responses of {cfg['size']}")
            r["cpu"] = {k: after[k] - before[k] for k in before}
            if "inside" in r:
                r["cpu"].update(kernel_inside=r["inside"]["kernel"], agent_inside=r["inside"]["agent"])
            return r

        total = ROUNDS * len(SCHEMES) * len(CELLS)
        step = 0
        progress(f"egress: {total * len(LOCATIONS)} measurements of {seconds:g} s "
                 f"({ROUNDS} rounds x {len(SCHEMES)} schemes x {len(CELLS)} cells x {len(LOCATIONS)} locations), "
                 f"at least {total * len(LOCATIONS) * seconds / 60:.1f} min with warmups on top")
        for rep in range(ROUNDS):
            for scheme in SCHEMES:
                for key, label, size, conc, mode in CELLS:
                    cfg = {"scheme": scheme, "host": PLAIN_NAME if scheme == "http" else TLS_NAME,
                           "port": ports[scheme], "path": f"/{size}", "size": size, "conc": conc, "mode": mode,
                           "warmup": 1 if size == LARGE else 3, "duration": seconds}
                    rot = step % len(LOCATIONS)
                    line = []
                    for loc in LOCATIONS[rot:] + LOCATIONS[:rot]:
                        r = measure(loc, cfg)
                        raw[scheme][key][loc].append(r)
                        el = r["elapsed_s"]
                        line.append(f"{loc} p50 {percentile(r['latency_ms'], 50):.2f} ms, {r['n'] / el:.0f} req/s"
                                    + (f", {r['bytes'] / el / 1e6:.0f} MB/s" if size == LARGE else ""))
                    step += 1
                    progress(f"[{step}/{total}] round {rep + 1}/{ROUNDS} {scheme} {label}: " + "; ".join(line))
    except KeyboardInterrupt:
        failed = "interrupted"
    except BenchError as e:
        failed = str(e)
    except Exception as e:  # something unforeseen: still clean up
        failed = f"{type(e).__name__}: {e}"
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # let the cleanup finish
        progress("stopping the gateway and the helpers")
        for k in kernels:
            try:
                k.close()
            except Exception:
                pass
        if t is not None:
            try:
                t.teardown()
            except Exception as e:
                progress(f"warning: cleanup of the gateway: {e}")
        for h in reversed(helpers):
            try:
                h.stop()
            except Exception as e:
                progress(f"warning: cleanup of {h.name}: {e}")
        signal.signal(signal.SIGTERM, old_term)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if failed:
        print(f"sandgate bench: {failed}\n  logs: {logdir}", file=sys.stderr)
        return 130 if failed == "interrupted" else 1

    summary = {s: {c: {loc: stats(rs) for loc, rs in cells.items()} for c, cells in by.items()}
               for s, by in raw.items()}
    ratios = {s: {c: round_ratios(cells) for c, cells in by.items()} for s, by in raw.items()}
    rt = {w: {"p50_ms": percentile(v, 50) * 1e3, "p99_ms": percentile(v, 99) * 1e3, "n": len(v)}
          for w, v in list(rt_raw.items()) + list(rt_each.items())}
    rt["ratio_p50"] = rt["egress_on"]["p50_ms"] / rt["egress_off"]["p50_ms"]
    rt["ratio_p99"] = rt["egress_on"]["p99_ms"] / rt["egress_off"]["p99_ms"]
    report = {
        "timestamp": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "host": {"cpu_count": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
                 "runsc": runsc_version(), "load_avg": os.getloadavg()},
        "config": {"rounds": ROUNDS, "seconds": seconds, "runs": runs, "cells": CELLS, "locations": LOCATIONS,
                   "upstream": {"http": f"{PLAIN_IP}:{ports['http']}", "https": f"{TLS_IP}:{ports['https']}"}},
        "wall_s": time.monotonic() - t_start,
        "boot_s": boot,
        "egress": summary,
        "egress_ratios": ratios,
        "roundtrip": rt,
        "raw": {"egress": {s: {c: {loc: [{k: v for k, v in r.items() if k != "latency_ms"} for r in rs]
                                   for loc, rs in cells.items()} for c, cells in by.items()}
                           for s, by in raw.items()},
                "roundtrip_s": rt_each},
    }
    Path(args.output).write_text(json.dumps(report, indent=1))
    shutil.rmtree(logdir, ignore_errors=True)
    print(egress_tables(summary, ratios))
    print()
    print(roundtrip_table(rt))
    print(f"\nboot to first 1+1: egress off {' '.join(f'{x:.1f}' for x in boot['egress_off'])} s, "
          f"on {' '.join(f'{x:.1f}' for x in boot['egress_on'])} s; load average at the end {os.getloadavg()[0]:.1f}; wall {report['wall_s']:.0f} s")
    print(f"raw numbers: {args.output}")
    return 0


if __name__ == "__main__":
    # Helper processes: `python -m sandgate_bench.egress upstream LEAF` and
    # `python -m sandgate_bench.egress proxy HOME CA HOSTS ALLOW_JSON`.
    if sys.argv[1] == "upstream":
        serve_upstream(sys.argv[2])
    elif sys.argv[1] == "proxy":
        import logging

        logging.basicConfig(level=logging.INFO, format="[%(levelname).1s %(asctime)s %(name)s] %(message)s")
        serve_proxy(*sys.argv[2:6])
    else:
        sys.exit(f"unknown helper {sys.argv[1]}")
