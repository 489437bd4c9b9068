"""`sandgate bench --fleet`: a three-node fleet on loopback.

A real redis-server (a free loopback port, a directory of its own) and three
``sandgate serve`` nodes (A, B, C) with homes of their own, the built image
shared, and one shared checkpoint directory. Measured:

* round trip: ``1+1`` on a kernel of node B, over the kernel websocket and the
  REST execute, straight to B and through A, interleaved round by round so
  host noise hits both; p50/p99 each and the ratio of the p50s (goal <= 1.2);
* routing lookups per second: what a node does to route a request
  (Fleet.locate: store.get + live_nodes) against the same Redis, one at a
  time and several concurrently;
* load: --fleet-kernels kernels placed by capacity across the nodes, each
  driven by its own client, half of them connected to a node that is not the
  owner, for --fleet-seconds (and at most --fleet-cells cells each): the load
  run of bench/load.py: p50/p99, cells/s, and lost, duplicated or out-of-order
  messages, which must be 0;
* node death: sandboxes on C, checkpointed; kill -9 C; from the kill to the
  first of them answering a cell through A (the take-over path), and all.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Dict, List, Optional

from .harness import TIMEOUT, BenchError, conclude, default_home, free_port, progress
from .targets import SandgateTarget
from .load import load as load_run, stats

GOAL = 1.2
HERE = {"X-Sandgate-Forwarded": "bench"}  # answered by the node asked, never forwarded or placed elsewhere


class Redis:
    """redis-server on a free loopback port, in a directory of its own."""

    def __init__(self, root: Path, persist: bool = False):
        """``persist``: an append-only file, so that a restart keeps the records (the chaos soak's)."""
        self.exe = shutil.which("redis-server")
        if not self.exe:
            raise BenchError("redis-server not found: the fleet keeps its records in Redis "
                             "(apt-get install redis-server)")
        self.dir = root / "redis"
        self.dir.mkdir()
        self.port = free_port()
        self.persist = persist
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen([self.exe, "--bind", "127.0.0.1", "--port", str(self.port), "--dir", str(self.dir),
                                      "--save", "", "--appendonly", "yes" if self.persist else "no"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 20
        import socket

        while True:
            if self.proc.poll() is not None:
                raise BenchError(f"redis-server exited with status {self.proc.returncode} while starting")
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            if time.monotonic() > deadline:
                raise BenchError(f"redis-server did not listen on port {self.port} within 20 s")
            time.sleep(0.05)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def restart(self) -> None:
        self.stop()
        self.start()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def call(node: SandgateTarget, method: str, path: str, body=None, headers=None, expect=(200,), timeout=TIMEOUT):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"http://127.0.0.1:{node.port}{path}", data=data, method=method,
                                 headers={"Authorization": f"token {node.token}", "Content-Type": "application/json",
                                          **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            status, out = r.status, (json.loads(raw) if raw else None)
    except urllib.error.HTTPError as e:
        status, out = e.code, e.read().decode(errors="replace")
    except OSError as e:
        raise BenchError(f"{node.name}: {method} {path} failed: {e}\n{node.log_tail()}") from None
    if expect and status not in expect:
        raise BenchError(f"{node.name}: {method} {path} answered {status}: {out}\n{node.log_tail()}")
    return status, out


# -- round trip ------------------------------------------------------------------

def round_trip(a: SandgateTarget, b: SandgateTarget, sid: str, rounds: int) -> dict:
    from sandgate_client import Sandbox

    direct, through = b.connect(sid), a.connect(sid)
    # The same sandbox through each node's URL: SDK handles for the REST execute.
    rest = {"direct": Sandbox.connect(sid, b.url, b.token), "through": Sandbox.connect(sid, a.url, a.token)}
    raw: Dict[str, List[float]] = {"ws_direct": [], "ws_through": [], "rest_direct": [], "rest_through": []}
    try:
        for _ in range(5):  # warm both paths
            direct.execute("1+1")
            through.execute("1+1")
        for i in range(rounds):
            # alternate which goes first, so neither always follows the other
            order = [("direct", direct, b), ("through", through, a)]
            for name, k, node in (order if i % 2 == 0 else order[::-1]):
                t0 = time.perf_counter()
                k.execute("1+1")
                raw[f"ws_{name}"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                ex = node.sdk(f"1+1 in {sid}", lambda: rest[name].run_code("1+1", timeout=TIMEOUT))
                raw[f"rest_{name}"].append(time.perf_counter() - t0)
                if ex.text != "2":
                    raise BenchError(f"{node.name}: 1+1 in {sid} gave {ex.text!r}")
    finally:
        direct.close()
        through.close()
    out = {k: stats(v) for k, v in raw.items()}
    for kind in ("ws", "rest"):
        out[f"{kind}_ratio"] = out[f"{kind}_through"]["p50_ms"] / out[f"{kind}_direct"]["p50_ms"]
    return out


# -- routing lookups -------------------------------------------------------------

def lookups(redis_url: str, sid: str, seconds: float, concurrency: List[int]) -> dict:
    from sandgate.store.redis import RedisStore

    async def measure(n: int) -> float:
        store = RedisStore(redis_url, "bench")
        done = 0
        end = time.monotonic() + seconds

        async def worker():
            nonlocal done
            while time.monotonic() < end:
                # Fleet.locate for a sandbox held elsewhere: its record, then the live nodes
                rec = await store.get(sid)
                nodes = await store.live_nodes()
                if rec is None or rec.node not in nodes:
                    raise BenchError(f"routing lookup: sandbox {sid} not found on a live node")
                done += 1

        t0 = time.monotonic()
        try:
            await asyncio.gather(*(worker() for _ in range(n)))
        finally:
            await store.close()
        return done / (time.monotonic() - t0)

    return {str(n): asyncio.run(measure(n)) for n in concurrency}


# -- load ------------------------------------------------------------------------

def load(nodes: List[SandgateTarget], kernels: List[str], owner: Dict[str, int], seconds: float,
         max_cells: int) -> dict:
    """The shared load run (bench/load.py), every second kernel through a node that does not hold it."""
    clients = [nodes[owner[sid]] if n % 2 == 0 else nodes[(owner[sid] + 1) % len(nodes)] for n, sid in enumerate(kernels)]
    conns = [node.connect(sid) for node, sid in zip(clients, kernels)]
    try:
        out = load_run(conns, seconds, max_cells)
    finally:
        for k in conns:
            k.close()
    return {**out, "through_other_node": len(kernels) // 2}


# -- node death ------------------------------------------------------------------

def node_death(a: SandgateTarget, c: SandgateTarget, sids: List[str]) -> dict:
    # Raw calls here, not the SDK: its retry of a 503 (backoff up to 4 s) would blur the time to the first answer.
    for sid in sids:
        call(c, "POST", f"/api/sandboxes/{sid}/execute", {"code": "x = 41"})
        call(c, "POST", f"/api/sandboxes/{sid}/checkpoints", {}, expect=(200, 201))
    progress(f"{len(sids)} sandboxes on {c.name} checkpointed; kill -9 {c.name}")
    t0 = time.monotonic()
    os.kill(c.proc.pid, signal.SIGKILL)
    c.proc.wait()
    answered: Dict[str, float] = {}
    deadline = t0 + 180
    while len(answered) < len(sids):
        if time.monotonic() > deadline:
            raise BenchError(f"after {c.name}'s death, {len(sids) - len(answered)} of its sandboxes did not answer "
                             f"through {a.name} within 180 s:\n{a.log_tail()}")
        for sid in sids:
            if sid in answered:
                continue
            status, out = call(a, "POST", f"/api/sandboxes/{sid}/execute", {"code": "print(x)"}, expect=())
            if status == 200 and isinstance(out, dict) and out.get("stdout") == "41\n":
                answered[sid] = time.monotonic() - t0
            elif status not in (200, 503):
                raise BenchError(f"{a.name}: execute in {sid} after {c.name}'s death answered {status}: {out}")
        if len(answered) < len(sids):
            time.sleep(0.2)  # polling interval: the condition is the 200 above
    return {"sandboxes": len(sids), "first_s": min(answered.values()), "all_s": max(answered.values())}


# -- the run ---------------------------------------------------------------------

def preflight(home: Path) -> None:
    from sandgate_images import rootfs as images

    from sandgate.drivers.gvisor import runsc_path

    from .harness import need_psutil

    need_psutil()
    if not runsc_path(os.environ.get("SANDGATE_RUNSC", "")):
        raise BenchError("runsc not found: install gVisor (apt-get install runsc), then `sandgate doctor`")
    if not shutil.which("redis-server"):
        raise BenchError("redis-server not found: the fleet keeps its records in Redis (apt-get install redis-server)")
    if not images.is_built(home):
        flag = f" --home {home}" if home != default_home() else ""
        raise BenchError(f"the sandbox image is not built in {home}: run `sandgate image build{flag}`")


def run(args) -> int:
    home = Path(args.home) if args.home else default_home()
    n_kernels = max(3, args.fleet_kernels)
    seconds = max(1.0, args.fleet_seconds)
    rounds = max(5, args.runs if args.runs != 200 else 100)
    logdir = Path(tempfile.mkdtemp(prefix="sandgate-bench-fleet-"))
    nodes: List[SandgateTarget] = []
    redis = None
    report: Dict[str, object] = {}
    failed = None
    made: List[str] = []
    try:
        preflight(home)
        redis = Redis(logdir)
        shared = logdir / "checkpoints"
        shared.mkdir()
        per_node = max(16, n_kernels // 3 + 8)
        token, fleet_key = os.urandom(16).hex(), os.urandom(32).hex()
        for name in "abc":
            env = {"SANDGATE_REDIS_URL": redis.url, "SANDGATE_WARM_START": "false", "SANDGATE_NODE_ID": f"node-{name}",
                   "SANDGATE_CHECKPOINT_STORE": str(shared), "SANDGATE_MAX_KERNELS": str(per_node),
                   "SANDGATE_KEEP_SANDBOXES": "false", "SANDGATE_TENANT_CREATE_RATE": "0",
                   "SANDGATE_TENANT_MAX_SANDBOXES": "0", "SANDGATE_TENANT_MAX_MEMORY_MB": "0",
                   "SANDGATE_FLEET_KEY": fleet_key}
            t = SandgateTarget(logdir, home, f"node-{name}", env)
            t.token = token  # one admin token across the fleet
            nodes.append(t)
        for t in nodes:
            progress(f"starting {t.name} on port {t.port} (log {t.log_path})")
            t.setup()
        a, b, c = nodes

        _, out = call(b, "POST", "/api/sandboxes", {}, headers=HERE, expect=(201,))
        sid = out["id"]
        made.append(sid)
        progress(f"round trip: {rounds} rounds on {sid} (node-b), direct and through node-a, interleaved")
        rt = round_trip(a, b, sid, rounds)
        progress(f"websocket p50 direct {rt['ws_direct']['p50_ms']:.2f} ms, through {rt['ws_through']['p50_ms']:.2f} ms "
                 f"(x{rt['ws_ratio']:.2f}); REST x{rt['rest_ratio']:.2f}")

        progress("routing lookups against Redis")
        lk = lookups(redis.url, sid, args.fleet_lookup_seconds, [1, 8])

        progress(f"load: creating {n_kernels} kernels across the fleet (placement by capacity)")
        kernels, owner = [], {}
        for i in range(n_kernels):
            _, out = call(nodes[i % 3], "POST", "/api/sandboxes", {}, expect=(201,))
            made.append(out["id"])
            kernels.append(out["id"])
            for j, t in enumerate(nodes):
                if call(t, "GET", f"/api/sandboxes/{out['id']}", headers=HERE, expect=())[0] == 200:
                    owner[out["id"]] = j
            if out["id"] not in owner:
                raise BenchError(f"kernel {out['id']}: no node says it holds it")
        spread = {t.name: sum(1 for o in owner.values() if o == j) for j, t in enumerate(nodes)}
        progress(f"placed: {spread}; driving them for {seconds:g} s")
        ld = load(nodes, kernels, owner, seconds, args.fleet_cells)
        ld["placement"] = spread
        progress(f"load: {ld['cells']} cells, {ld['cells_per_s']:.1f}/s, lost {ld['lost']}"
                 + "".join(f"\n  {e}" for e in ld["errors"]))
        for sid_ in kernels:  # room on C for the death section
            call(a, "DELETE", f"/api/sandboxes/{sid_}", expect=(204, 404))
            made.remove(sid_)

        n_dead = max(1, args.fleet_death)
        doomed = []
        for _ in range(n_dead):
            _, out = call(c, "POST", "/api/sandboxes", {}, headers=HERE, expect=(201,))
            doomed.append(out["id"])
            made.append(out["id"])
        death = node_death(a, c, doomed)
        progress(f"death: first answered after {death['first_s']:.1f} s, all after {death['all_s']:.1f} s")

        load1, load5, load15 = os.getloadavg()
        report = {
            "timestamp": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "cpu_count": os.cpu_count(), "loadavg": [load1, load5, load15], "goal_ratio": GOAL,
            "round_trip": rt, "routing_lookups_per_s": lk, "load": ld, "node_death": death,
        }
    except KeyboardInterrupt:
        failed = "interrupted"
    except BenchError as e:
        failed = str(e)
    finally:
        progress("cleaning up: sandboxes, nodes, redis")
        try:
            _cleanup(nodes, made, redis)
        except Exception as e:
            progress(f"warning: cleanup: {e}")
    return conclude(failed, logdir, args.output, report, table)


def _cleanup(nodes: List[SandgateTarget], made: List[str], redis: Optional[Redis]) -> None:
    live = [t for t in nodes if t.proc and t.proc.poll() is None]
    dead = [t for t in nodes if t.proc and t.proc.poll() is not None and t.proc.returncode == -signal.SIGKILL]
    for t in dead:
        # a node killed -9 left its runtimes behind: started again on its home, it reaps them
        try:
            t._log.close()
            t.setup()
            live.append(t)
        except Exception as e:
            progress(f"warning: restarting {t.name} to reap its sandboxes: {e}")
    for sid in made:
        for t in live:
            try:
                if call(t, "DELETE", f"/api/sandboxes/{sid}", expect=(), timeout=60)[0] in (204, 404):
                    break
            except BenchError:
                continue
    for t in nodes:
        t.kernels.clear()
        try:
            t.teardown()
        except Exception as e:
            progress(f"warning: stopping {t.name}: {e}")
    if redis:
        redis.stop()


def table(r: dict) -> str:
    rt, lk, ld, d = r["round_trip"], r["routing_lookups_per_s"], r["load"], r["node_death"]
    rows = [f"| fleet of 3 nodes on loopback ({r['cpu_count']} CPUs, load {r['loadavg'][0]:.1f}) | |", "| --- | --- |"]
    for kind, label in (("ws", "websocket"), ("rest", "REST execute")):
        rows.append(f"| `1+1` {label} p50/p99 direct to B | {rt[kind + '_direct']['p50_ms']:.2f} / "
                    f"{rt[kind + '_direct']['p99_ms']:.2f} ms |")
        rows.append(f"| `1+1` {label} p50/p99 through A | {rt[kind + '_through']['p50_ms']:.2f} / "
                    f"{rt[kind + '_through']['p99_ms']:.2f} ms |")
        rows.append(f"| {label} ratio through/direct (goal <= {GOAL}) | {rt[kind + '_ratio']:.2f}x |")
    rows += [f"| routing lookups/s ({n} concurrent) | {v:,.0f} |" for n, v in lk.items()]
    rows += [f"| load: {ld['kernels']} kernels ({ld['through_other_node']} via a non-owner), {ld['seconds']:.0f} s | "
             f"{ld['cells']} cells, {ld['cells_per_s']:.1f} cells/s |",
             f"| load p50/p99 | {ld.get('p50_ms', 0):.1f} / {ld.get('p99_ms', 0):.1f} ms |",
             f"| lost messages | {ld['lost']} |",
             f"| duplicated or out-of-order messages | {ld['duplicated'] + ld['out_of_order']} |",
             f"| cells whose stdout came in more than one stream message (joined, not lost) | {ld['split_stdout']} |",
             f"| kill -9 to first restored sandbox answering (of {d['sandboxes']}) | {d['first_s']:.1f} s |",
             f"| kill -9 to all answering | {d['all_s']:.1f} s |"]
    return "\n".join(rows)
