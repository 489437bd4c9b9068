"""The load run: kernels driven at once, each by a client thread of its own, running cells back
to back. `sandgate bench --load N` runs it on N sandboxes of one gateway beside the same on N local
ipykernels behind Jupyter Kernel Gateway; `sandgate bench --fleet` runs it across three nodes.

Every cell prints a token of its connection and its count (``print('<token>:<i>')``). A cell counts
as lost unless its execute_reply (ok), exactly that stdout line and its idle status all arrive,
matched by msg_id, within ``CELL_TIMEOUT``; as duplicated if any of them came twice (or a finished
cell's message came again later). At the end each connection's stdout, read in arrival order across
all its messages, must be its cells' lines once each and in order. Reported: p50/p99 round trip,
cells/s, messages relayed (sent and received by the clients) and the gateway process's CPU seconds
(/proc/<pid>/stat utime + stime) per message. The run is bounded: a client still in a cell at
``seconds + CELL_TIMEOUT + 30`` counts that cell lost and the run ends without it.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Dict, List, Optional

from .harness import BenchError, conclude, default_home, percentile, preflight, progress, runsc_version
from .targets import KernelGatewayTarget, SandgateTarget, WSKernel

CELL_TIMEOUT = 60.0  # a cell's messages not all in by then count as lost
STRAGGLERS = 30.0  # past seconds + CELL_TIMEOUT: the hard end of the load phase


def timeouts() -> tuple:
    """What a client's recv raises when nothing came in time: the SDK's and websocket-client's."""
    import websocket
    from sandgate_client import Timeout

    return (Timeout, websocket.WebSocketTimeoutException)


class Client:
    """One kernel connection (``send``/``recv``: the SDK's, or the bench's plain websocket) and what came back on it."""

    def __init__(self, kernel):
        self.k = kernel
        self.token = uuid.uuid4().hex[:12]
        self.times: List[float] = []
        self.errors: List[str] = []
        self.lost = self.duplicated = self.out_of_order = self.split = self.messages = 0
        self.stdout: List[str] = []  # every stdout text on this connection, in arrival order
        self.expected: List[str] = []
        self.done = set()  # msg_ids of finished cells: a message of theirs now is a duplicate

    def cell(self, i: int) -> None:
        """One cell, checked; its round trip kept, or why it failed counted. Raw messages, not
        ``execute``: a lost reply is counted here, not raised."""
        line = f"{self.token}:{i}\n"
        t0 = time.perf_counter()
        # store_history off: 50 local ipykernels share one IPython history database, whose
        # "database is locked" warning lands in a cell's stdout (a sandbox has a database of its own)
        mid = self.k.send("execute_request", {"code": f"print('{self.token}:{i}')", "silent": False,
                                              "store_history": False, "user_expressions": {}, "allow_stdin": False})
        self.messages += 1
        self.expected.append(line)
        deadline = time.monotonic() + CELL_TIMEOUT
        status, text, replies, idles, pieces = None, "", 0, 0, 0
        while not (replies and idles):  # ipykernel flushes a cell's stdout before its idle status
            left = deadline - time.monotonic()
            try:
                if left <= 0:  # by the clock: a connection's pings must not keep a lost cell waiting
                    raise TimeoutError
                m = self.k.recv(left)
            except (TimeoutError,) + timeouts():
                self.lost += 1
                self.errors.append(f"{self.k.id}: cell {i} (msg_id {mid}) incomplete after {CELL_TIMEOUT:g} s: "
                                   f"execute_reply {status or 'missing'}, stdout {text!r}, idle status "
                                   f"{'seen' if idles else 'missing'}")
                return
            self.messages += 1
            parent = m.get("parent_header", {}).get("msg_id")
            t = m.get("msg_type") or m["header"]["msg_type"]
            stdout = t == "stream" and m["content"].get("name") == "stdout"
            if stdout:
                self.stdout.append(m["content"].get("text", ""))
            if parent in self.done:
                self.duplicated += 1
                self.errors.append(f"{self.k.id}: a {t} of a finished cell came again during cell {i}")
            elif parent != mid:
                continue
            elif t == "execute_reply":
                replies += 1
                status = m["content"].get("status")
            elif stdout:
                text += m["content"].get("text", "")
                pieces += 1
            elif t == "status" and m["content"].get("execution_state") == "idle":
                idles += 1
        self.done.add(mid)
        if replies > 1 or idles > 1 or text.count(line) > 1:
            self.duplicated += 1
            self.errors.append(f"{self.k.id}: cell {i}: {replies} execute_replies, {idles} idle statuses, stdout {text!r}")
        elif status != "ok" or text != line:
            self.lost += 1
            self.errors.append(f"{self.k.id}: cell {i}: execute_reply {status}, stdout {text!r} (expected {line!r})")
        else:
            self.split += pieces > 1  # a loaded kernel may flush print's text and newline as two messages
            self.times.append(time.perf_counter() - t0)

    def check_order(self) -> None:
        """Every cell's line once, in order, in what the connection carried (unless already counted)."""
        if not (self.lost or self.duplicated) and "".join(self.stdout) != "".join(self.expected):
            self.out_of_order += 1
            self.errors.append(f"{self.k.id}: stdout out of order or mixed: {''.join(self.stdout)[:200]!r}")


def stats(xs: List[float]) -> dict:
    return {"n": len(xs), "p50_ms": percentile(xs, 50) * 1e3, "p99_ms": percentile(xs, 99) * 1e3} if xs else {"n": 0}


def cpu_seconds(pid: int) -> float:
    """utime + stime of one process (not its children: the kernels' own CPU is theirs)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def load(kernels: list, seconds: float, max_cells: Optional[int] = None, gateway_pid: Optional[int] = None) -> dict:
    """Drive every kernel (already connected) for ``seconds``: the figures, failures counted, never raised."""
    clients = [Client(k) for k in kernels]
    start = threading.Event()
    end = [0.0]

    def drive(c: Client):
        start.wait()
        i = 0
        try:
            while (max_cells is None or i < max_cells) and time.monotonic() < end[0]:
                c.cell(i)
                i += 1
            c.check_order()
        except Exception as e:  # a connection dropped: its cell is lost, and says why
            c.lost += 1
            c.errors.append(f"{c.k.id}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=drive, args=(c,), daemon=True) for c in clients]
    for t in threads:
        t.start()
    cpu0 = cpu_seconds(gateway_pid) if gateway_pid else None
    t0 = time.monotonic()
    end[0] = t0 + seconds
    start.set()
    bound = t0 + seconds + CELL_TIMEOUT + STRAGGLERS  # each recv is bounded by the clock: this is a backstop
    for t in threads:
        t.join(max(0.0, bound - time.monotonic()))
    wall = time.monotonic() - t0
    cpu = cpu_seconds(gateway_pid) - cpu0 if gateway_pid else None
    for c, t in zip(clients, threads):
        if t.is_alive():  # a hung client: its cell is lost; its socket is left to the caller's cleanup
            c.lost += 1
            c.errors.append(f"{c.k.id}: still in a cell at the hard end of the run ({wall:.0f} s)")
    times = [x for c in clients for x in c.times]
    messages = sum(c.messages for c in clients)
    failures = {key: sum(getattr(c, key) for c in clients) for key in ("lost", "duplicated", "out_of_order")}
    out = {"kernels": len(clients), "seconds": wall, "cells": len(times), "cells_per_s": len(times) / wall,
           **failures, "failures": sum(failures.values()), "errors": [e for c in clients for e in c.errors][:5],
           "split_stdout": sum(c.split for c in clients), "messages": messages, **stats(times)}
    if cpu is not None:
        out.update(gateway_cpu_s=cpu, gateway_cpu_us_per_message=cpu / messages * 1e6 if messages else None)
    return out


# -- `sandgate bench --load N` ------------------------------------------------------

def start_all(target, n: int, bound: float) -> List[str]:
    """n kernels, one after another, each checked with 1+1; progress as they come up. Their websockets
    are closed again: one left unread while the rest start answers no pings, and a gateway closes it
    (Tornado: no pong within 90 s)."""
    ids = []
    t0 = time.monotonic()
    for i in range(n):
        if time.monotonic() - t0 > bound:
            raise BenchError(f"{target.name}: only {i} of {n} kernels up after {bound:.0f} s")
        k = target.start_kernel()
        if (k.execute("1+1")["result"] or {}).get("text/plain") != "2":
            raise BenchError(f"{target.name}: 1+1 in kernel {k.id} gave no 2")
        k.close()
        ids.append(k.id)
        if (i + 1) % 5 == 0 or i + 1 == n:
            progress(f"{target.name}: {i + 1}/{n} kernels up ({time.monotonic() - t0:.0f} s)")
    return ids


def connect_all(target, ids: List[str]) -> list:
    """A fresh websocket to each kernel, just before the load (the SDK's for Sandgate); the target closes them."""
    for kid in ids:
        target.kernels[kid] = (target.connect(kid) if isinstance(target, SandgateTarget)
                               else WSKernel(target.port, target.token, kid))
    return [target.kernels[kid] for kid in ids]


def measure(target, n: int, seconds: float) -> dict:
    progress(f"starting {target.name} on port {target.port} (log {target.log_path})")
    target.setup()
    t0 = time.monotonic()
    ids = start_all(target, n, bound=max(300.0, 20.0 * n))
    started = time.monotonic() - t0
    kernels = connect_all(target, ids)
    progress(f"{target.name}: driving {n} kernels for {seconds:g} s")
    r = load(kernels, seconds, gateway_pid=target.proc.pid)
    r.update(start_all_s=started, loadavg=list(os.getloadavg()))
    progress(f"{target.name}: {r['cells']} cells, {r['cells_per_s']:.1f}/s, p50 {r.get('p50_ms', 0):.1f} ms, "
             f"lost {r['lost']}, duplicated {r['duplicated']}, out of order {r['out_of_order']}"
             + "".join(f"\n  {e}" for e in r["errors"]))
    return r


RATIO_KEYS = ("start_all_s", "p50_ms", "p99_ms", "cells_per_s", "gateway_cpu_us_per_message")


def run(args) -> int:
    n, seconds = args.load, args.load_seconds
    if n < 1 or seconds <= 0:
        print("sandgate bench: --load needs at least 1 kernel and --load-seconds above 0", file=sys.stderr)
        return 2
    home = Path(args.home) if args.home else default_home()
    logdir = Path(tempfile.mkdtemp(prefix="sandgate-bench-load-"))
    # The gateway admits n kernels: its own cap and the tenant quotas (the bench's admin token is a tenant too).
    sg = SandgateTarget(logdir, home, "sandgate-gvisor", {
        "SANDGATE_MAX_KERNELS": str(n + 2), "SANDGATE_POOL_SIZE": "1", "SANDGATE_KEEP_SANDBOXES": "false",
        "SANDGATE_TENANT_MAX_SANDBOXES": "0", "SANDGATE_TENANT_MAX_MEMORY_MB": "0", "SANDGATE_TENANT_CREATE_RATE": "0"})
    kg = KernelGatewayTarget(logdir)
    report: Dict[str, object] = {}
    failed = None
    try:
        preflight(home)
        load0 = list(os.getloadavg())
        # One side at a time, the baseline first and stopped: 2n kernels at once would share the CPUs.
        results = {}
        for t in (kg, sg):
            try:
                results[t.name] = measure(t, n, seconds)
            finally:
                progress(f"stopping {t.name} and its kernels")
                t.teardown()
        s, b = results[sg.name], results[kg.name]
        report = {
            "timestamp": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "host": {"cpu_count": os.cpu_count(), "python": platform.python_version(),
                     "platform": platform.platform(), "runsc": runsc_version()},
            "loadavg_at_start": load0, "n": n, "seconds": seconds, "cell_timeout_s": CELL_TIMEOUT,
            "sandgate": s, "kernel-gateway": b,
            "ratios": {k: (s[k] / b[k] if s.get(k) is not None and b.get(k) else None) for k in RATIO_KEYS},
        }
        if s["failures"] or b["failures"]:
            failed = (f"messages lost or duplicated: sandgate {s['failures']}, kernel-gateway {b['failures']}: "
                      + "; ".join(s["errors"] + b["errors"]))
            Path(args.output).write_text(json.dumps(report, indent=1))  # the figures, for the post-mortem
    except KeyboardInterrupt:
        failed = "interrupted"
    except BenchError as e:
        failed = str(e)
    finally:
        kg.teardown()
        sg.teardown()
    return conclude(failed, logdir, args.output, report, table)


def table(r: dict) -> str:
    s, b, q = r["sandgate"], r["kernel-gateway"], r["ratios"]

    def f(v, fmt):
        return "-" if v is None else fmt.format(v)

    rows = [("start all, one after another (s)", "start_all_s", "{:.1f}"),
            ("cells", "cells", "{:d}"), ("cells/s", "cells_per_s", "{:.1f}"),
            ("round trip p50 (ms)", "p50_ms", "{:.1f}"), ("round trip p99 (ms)", "p99_ms", "{:.1f}"),
            ("messages relayed", "messages", "{:d}"), ("gateway CPU (s)", "gateway_cpu_s", "{:.2f}"),
            ("gateway CPU per message (us)", "gateway_cpu_us_per_message", "{:.0f}"),
            ("lost", "lost", "{:d}"), ("duplicated", "duplicated", "{:d}"), ("out of order", "out_of_order", "{:d}"),
            ("load average (1 min) at the end", None, None)]
    out = [f"| {r['n']} kernels x {r['seconds']:g} s ({r['host']['cpu_count']} CPUs) | kernel-gateway + local "
           f"ipykernel | sandgate (gVisor) | ratio |", "| --- | ---: | ---: | ---: |"]
    for label, key, fmt in rows:
        if key is None:
            out.append(f"| {label} | {b['loadavg'][0]:.1f} | {s['loadavg'][0]:.1f} | |")
            continue
        ratio = q.get(key)
        out.append(f"| {label} | {f(b.get(key), fmt)} | {f(s.get(key), fmt)} | {f(ratio, '{:.2f}x')} |")
    return "\n".join(out)
