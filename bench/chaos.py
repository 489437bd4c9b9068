"""The chaos soak: `sandgate bench --chaos [--minutes M --seed S --nodes N]`.

Clients (``--chaos-clients``, one thread each, a sandbox or two each) do random operations (counter
cells, checkpoint, fork, pause to disk and to memory, resume, restart, delete, file put and get)
against one gateway, or a fleet of N nodes sharing a redis-server (append-only, so a restart keeps
its records) and a checkpoint directory, while faults land at random: SIGKILL or SIGTERM of a
gateway (started again on the same home), a kill of one sandbox's shim or runsc sandbox process, and
in a fleet a Redis restart and a node's death (kill -9, down for longer than the heartbeat's TTL, so
its sandboxes are taken over, then started again on its home). After each fault the injector waits
until every sandbox it touched answers a read cell again: that time is the fault's recovery.

Every client keeps the invariant checker's ``Ledger`` (bench/invariants.py); at the end, with nothing
in flight, ``check`` runs against each node and its home. Reported: operations run (by kind, with
how many failed), faults injected (by kind), invariant violations (the goal is zero) and recovery
p50/p99. One seed gives each client's sequence of operation kinds and the sequence of fault kinds; when
they land, and on which sandbox or process, depends on the machine's timing, so a failing run is
reproduced by its seed as a scenario, not to the millisecond.
The bench fails (exit 1) when it could not run; violations are reported, not an exit status.
"""

from __future__ import annotations

import datetime as dt
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

from .invariants import (COUNTER_CELL, READ_CELL, Api, Ledger, Violation, check, check_leaks, list_sandboxes,
                         runsc_sandboxes)
from .invariants import _processes as host_processes
from .harness import BenchError, conclude, default_home, preflight, progress
from .targets import SandgateTarget

OPERATIONS = {"execute": 10, "checkpoint": 2, "fork": 1, "pause_disk": 1, "pause_memory": 1, "resume": 1,
              "restart": 1, "delete": 1, "files": 2}
FAULTS_ONE = ("gateway_kill", "gateway_term", "shim_kill", "runsc_kill")
FAULT_DISK = "disk_full"  # with homes on loop files of their own: never the host's disk
FAULTS_FLEET = ("redis_restart", "node_death")
FLEET_KEY = "chaos-fleet-key-0123456789abcdef0123456789abcdef"
LEASE = 30  # seconds: a dead node's runtimes end while the soak still runs
RECOVERY_BOUND = 240.0  # seconds a fault's sandboxes have to answer again before it counts as not recovered
MAX_PER_CLIENT = 2


class Fleet:
    """The gateways (one, or N sharing Redis), started again on their homes after a fault."""

    def __init__(self, logdir: Path, image_home: Path, nodes: int, disk_mb: int = 0):
        self.logdir, self.redis, self.lock = logdir, None, threading.Lock()
        self.mounted: List[Path] = []
        common = {"SANDGATE_KEEP_SANDBOXES": "true", "SANDGATE_WARM_START": "false", "SANDGATE_POOL_SIZE": "0",
                  "SANDGATE_MAX_KERNELS": "32", "SANDGATE_TENANT_MAX_SANDBOXES": "0",
                  "SANDGATE_TENANT_CREATE_RATE": "0", "SANDGATE_RUNTIME_LEASE": str(LEASE)}
        if nodes > 1:
            from .fleet import Redis

            self.redis = Redis(logdir, persist=True)
            (logdir / "checkpoints").mkdir()
            common.update(SANDGATE_REDIS_URL=self.redis.url, SANDGATE_FLEET_KEY=FLEET_KEY,
                          SANDGATE_CHECKPOINT_STORE=str(logdir / "checkpoints"))
        self.nodes: List[SandgateTarget] = []
        for i in range(nodes):
            name = f"node-{chr(ord('a') + i)}"
            self.nodes.append(SandgateTarget(logdir, image_home, name, {**common, "SANDGATE_NODE_ID": name}))
            if disk_mb:
                self.small_home(self.nodes[-1].home, disk_mb)
        self.starts: Dict[str, int] = {}
        self.down: set = set()

    def small_home(self, home: Path, mb: int) -> None:
        """The home on an ext4 file system of ``mb`` MiB in a loop file, so that filling it fills
        nothing else; the built image stays outside, through its symlink."""
        if os.geteuid() != 0:
            raise BenchError("a home on a loop file needs root: run as root, or --chaos-disk-mb 0 (no full-disk faults)")
        image, link = home.with_suffix(".img"), os.readlink(home / "images")
        with open(image, "wb") as f:
            f.truncate(mb << 20)
        for argv in (["mkfs.ext4", "-q", "-F", str(image)], ["mount", "-o", "loop", str(image), str(home)]):
            r = subprocess.run(argv, capture_output=True, text=True)
            if r.returncode:
                raise BenchError(f"{' '.join(argv[:2])}: {r.stderr.strip()}")
        self.mounted.append(home)
        (home / "images").symlink_to(link, target_is_directory=True)

    def fill(self, t: SandgateTarget) -> Path:
        """Fill the node's home to its last block; returns the file that does it."""
        filler = t.home / "chaos-filler"
        with open(filler, "wb") as f:
            block = bytes(1 << 20)
            try:
                while True:
                    f.write(block)
            except OSError:  # ENOSPC: full
                pass
        return filler

    def start(self, t: SandgateTarget) -> None:
        n = self.starts[t.name] = self.starts.get(t.name, 0) + 1
        t.log_path = self.logdir / f"{t.name}-{n}.log"  # one log per incarnation
        t.setup()
        self.down.discard(t.name)

    def stop(self, t: SandgateTarget, sig: int) -> None:
        self.down.add(t.name)
        if t.proc and t.proc.poll() is None:
            t.proc.send_signal(sig)
            t.proc.wait(600)
        t._log.close()

    def up(self) -> List[SandgateTarget]:
        return [t for t in self.nodes if t.name not in self.down]

    def api(self, rng: random.Random) -> Optional[Api]:
        live = self.up()
        if not live:
            return None
        t = rng.choice(live)
        return Api(t.url, t.token, timeout=60)

    def close(self) -> None:
        for t in self.nodes:
            if t.proc and t.proc.poll() is None:
                t.proc.terminate()
                try:
                    t.proc.wait(300)
                except Exception:
                    t.proc.kill()
        if self.redis:
            self.redis.stop()
        for home in self.mounted:
            subprocess.run(["umount", "-R", "-l", str(home)], capture_output=True)  # lazily: a busy one goes when freed


class Client(threading.Thread):
    """One user: its own sandboxes, its own sequence of operations, the shared ledger."""

    def __init__(self, n: int, seed: int, fleet: Fleet, ledger: Ledger, lock: threading.Lock, stop: threading.Event):
        super().__init__(name=f"chaos-client-{n}", daemon=True)
        self.rng = random.Random(seed * 1000 + n)  # its operations: the same for the same seed
        self.net = random.Random(seed * 1000 + n + 500)  # which node it asks: apart, so retries do not shift them
        self.fleet, self.ledger, self.lock, self.stop = fleet, ledger, lock, stop
        self.mine: List[str] = []
        self.checkpoints: Dict[str, List[str]] = {}
        self.ops: Dict[str, List[int]] = {}  # kind -> [run, failed]
        self.errors: Dict[str, List[str]] = {}  # kind -> the first few failures' answers, for the report
        self.last = ""  # the last call's answer when it failed

    def call(self, method: str, path: str, body=None):
        api = self.fleet.api(self.net)
        if api is None:
            self.last = f"{method} {path.split('/')[-1]}: no node is up"
            return 0, "no node is up"
        try:
            code, out = api.call(method, path, body)
        except OSError as e:  # the node died under the call: the answer is unknown
            code, out = 0, str(e)
        if code >= 300 or code == 0 or (isinstance(out, dict) and out.get("status") == "error"):
            self.last = f"{method} {path.split('/')[-1]}: {code} {str(out)[:300]}"
        return code, out

    def run(self) -> None:
        kinds, weights = zip(*OPERATIONS.items())
        while not self.stop.is_set():
            if not self.fleet.up():  # every gateway down (being restarted): no operation to count, only a wait
                self.stop.wait(0.5)
                continue
            if not self.mine:
                self.create()
                continue
            kind = self.rng.choices(kinds, weights)[0]
            sid = pick(self.rng, self.mine)
            self.last = ""
            ok = getattr(self, kind)(sid)
            run = self.ops.setdefault(kind, [0, 0])
            run[0] += 1
            run[1] += not ok
            if not ok and len(self.errors.setdefault(kind, [])) < 3:
                self.errors[kind].append(self.last)
            if not ok:
                self.stop.wait(0.5)  # a gateway down: the next call waits for it a little, not in a spin

    def create(self) -> bool:
        code, m = self.call("POST", "/api/sandboxes", {})
        if code == 201:
            with self.lock:
                self.ledger.created(m["id"])
            self.mine.append(m["id"])
            return True
        self.stop.wait(1.0)
        return False

    def execute(self, sid: str) -> bool:
        with self.lock:
            self.ledger.sent(sid)
        code, out = self.call("POST", f"/api/sandboxes/{sid}/execute", {"code": COUNTER_CELL, "timeout": 60})
        with self.lock:
            if code == 200 and out.get("status") == "ok" and (out.get("stdout") or "").strip().isdigit():
                self.ledger.acked(sid, int(out["stdout"]))
                return True
            self.ledger.unanswered(sid)
        return False

    def checkpoint(self, sid: str) -> bool:
        code, cp = self.call("POST", f"/api/sandboxes/{sid}/checkpoints", {"name": "chaos"})
        if code == 201:
            with self.lock:
                self.ledger.checkpointed(sid, cp["id"])
            self.checkpoints.setdefault(sid, []).append(cp["id"])
        return code == 201

    def fork(self, sid: str) -> bool:
        cps = self.checkpoints.get(sid)
        if not cps or len(self.mine) >= MAX_PER_CLIENT:
            return self.checkpoint(sid)
        cid = pick(self.rng, cps)
        code, m = self.call("POST", f"/api/sandboxes/{sid}/fork", {"checkpoint": cid})
        if code == 201:
            with self.lock:
                self.ledger.forked(m["id"], cid)
            self.mine.append(m["id"])
        return code == 201

    def pause_disk(self, sid: str) -> bool:
        return self.call("POST", f"/api/sandboxes/{sid}/pause", {"mode": "disk"})[0] == 200

    def pause_memory(self, sid: str) -> bool:
        return self.call("POST", f"/api/sandboxes/{sid}/pause", {"mode": "memory"})[0] == 200

    def resume(self, sid: str) -> bool:
        return self.call("POST", f"/api/sandboxes/{sid}/resume", {})[0] == 200

    def restart(self, sid: str) -> bool:
        code, _ = self.call("POST", f"/api/kernels/{sid}/restart", {})
        with self.lock:
            self.ledger.restarted(sid, acknowledged=code == 200)
        return code == 200

    def delete(self, sid: str) -> bool:
        code, _ = self.call("DELETE", f"/api/sandboxes/{sid}")
        with self.lock:
            self.ledger.deleted(sid, acknowledged=code == 204)
        if code in (204, 404):
            self.mine.remove(sid)
            self.checkpoints.pop(sid, None)
        return code == 204

    def files(self, sid: str) -> bool:
        """A put then a get of a small file; files follow the workspace (a restore may take them back), so
        what comes back is not judged here: the checker judges state, this is load."""
        path = f"chaos-{self.rng.randrange(4)}.txt"
        data = self.rng.randbytes(self.rng.randrange(1, 32 << 10))
        return self.raw("PUT", f"/api/sandboxes/{sid}/files/{path}", data) == 201 and \
            self.raw("GET", f"/api/sandboxes/{sid}/files/{path}") == 200

    def raw(self, method: str, path: str, data: Optional[bytes] = None) -> int:
        """A call whose bodies are bytes, not JSON (files); its status, 0 if it got none."""
        import urllib.error
        import urllib.request

        api = self.fleet.api(self.net)
        if api is None:
            self.last = f"{method} {path.split('/')[-1]}: no node is up"
            return 0
        req = urllib.request.Request(api.url + path, data=data, method=method,
                                     headers={"Authorization": f"token {api.token}"})
        try:
            with urllib.request.urlopen(req, timeout=90) as r:
                r.read()
                return r.status
        except urllib.error.HTTPError as e:
            self.last = f"{method} {path.split('/')[-1]}: {e.code} {e.read()[:300]!r}"
            return e.code
        except OSError as e:
            self.last = f"{method} {path.split('/')[-1]}: {e}"
            return 0


class Injector(threading.Thread):
    """The faults, one at a time at random intervals, each waited out (its sandboxes answering again)."""

    def __init__(self, seed: int, fleet: Fleet, ledger: Ledger, lock: threading.Lock, stop: threading.Event,
                 interval: float, disk: bool = False):
        super().__init__(name="chaos-faults", daemon=True)
        self.rng = random.Random(seed)  # the faults: the same for the same seed
        self.probe = random.Random(seed + 1)  # which node recovery probes ask: as often as recovery takes
        self.fleet, self.ledger, self.lock, self.stop, self.interval = fleet, ledger, lock, stop, interval
        self.kinds = FAULTS_ONE + (FAULTS_FLEET if len(fleet.nodes) > 1 else ()) + ((FAULT_DISK,) if disk else ())
        self.injected: Dict[str, int] = {}
        self.recovery: List[float] = []
        self.by_kind: Dict[str, List[float]] = {}  # the same, per kind of fault
        self.unrecovered: List[str] = []
        self.error: Optional[str] = None

    def run(self) -> None:
        try:
            while not self.stop.wait(self.rng.uniform(0.5, 1.5) * self.interval):
                kind = self.rng.choice(self.kinds)
                self.injected[kind] = self.injected.get(kind, 0) + 1
                progress(f"fault {sum(self.injected.values())}: {kind}")
                t0, affected = time.monotonic(), self.inject(kind)
                self.wait_answering(kind, t0, affected)
                progress(f"  {len(affected)} sandboxes touched, {len(self.unrecovered)} not answering so far")
        except BenchError as e:
            self.error = str(e)
            self.stop.set()

    def live_sandboxes(self) -> List[str]:
        with self.lock:
            return [s for s, t in self.ledger.sandboxes.items() if t.deleted is None]

    def inject(self, kind: str) -> List[str]:
        """Inject one fault; the sandboxes it touched (every one there was, for a gateway, Redis or node)."""
        node, every = self.rng.choice(self.fleet.nodes), self.live_sandboxes()
        if kind in ("gateway_kill", "gateway_term"):
            self.fleet.stop(node, signal.SIGKILL if kind == "gateway_kill" else signal.SIGTERM)
            self.fleet.start(node)
            return every
        if kind in ("shim_kill", "runsc_kill"):
            marker = "shim.py" if kind == "shim_kill" else "runsc-sandbox"
            procs = sorted(runtime_processes(node.home, marker))
            if not procs:
                return []
            pid, cmd = pick(self.rng, procs)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                return []
            return [s for s in every if s in cmd]
        if kind == FAULT_DISK:  # full for a while, as a runaway log would make it, then freed
            filler = self.fleet.fill(node)
            self.stop.wait(self.rng.uniform(5, 20))
            filler.unlink()
            return every
        if kind == "redis_restart":
            self.fleet.redis.restart()
            return every
        # node_death: down past the heartbeat's TTL, so the other nodes take its sandboxes over
        self.fleet.stop(node, signal.SIGKILL)
        self.stop.wait(15)
        self.fleet.start(node)
        return every

    def wait_answering(self, kind: str, t0: float, affected: List[str]) -> None:
        deadline = t0 + RECOVERY_BOUND
        todo = set(affected)
        while todo and time.monotonic() < deadline:  # waited out even once the soak ends: it is counted
            for sid in sorted(todo):
                api = self.fleet.api(self.probe)
                with self.lock:
                    gone = self.ledger.sandboxes[sid].deleted is not None
                if gone:
                    todo.discard(sid)
                    continue
                code, out = api.call("POST", f"/api/sandboxes/{sid}/execute", {"code": READ_CELL, "timeout": 60}) \
                    if api else (0, None)
                if code == 200 or code == 404 or (code == 409 and "dead" in str(out)):  # answering, or gone, or dead
                    todo.discard(sid)
                    self.recovery.append(time.monotonic() - t0)
                    self.by_kind.setdefault(kind, []).append(self.recovery[-1])
            if todo:
                time.sleep(0.5)  # polled: a gateway restarting has nothing to wait on
        self.unrecovered += [f"{kind}: sandbox {s}" for s in sorted(todo)]


def pick(rng: random.Random, items: list):
    """One of ``items`` for one draw of ``rng`` whatever their number (choice() draws more for some
    lengths), so a list whose length depends on timing does not shift the seed's later choices."""
    return items[min(int(rng.random() * len(items)), len(items) - 1)]


def runtime_processes(home: Path, marker: str) -> List[tuple]:
    """(pid, command line) of this home's shims or runsc sandboxes: each names the home's runtime root."""
    root = str(home / "runtime" / "gvisor")
    return [(pid, cmd) for pid, cmd in host_processes() if root in cmd and marker in cmd]


def percentile(values: List[float], q: float) -> Optional[float]:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def soak(image_home: Path, logdir: Path, minutes: float, seed: int, nodes: int, clients: int,
         fault_interval: float, disk_mb: int = 0) -> dict:
    """Run the soak; its report (raises BenchError when it could not run)."""
    fleet = Fleet(logdir, image_home, nodes, disk_mb)
    ledger, lock, stop = Ledger(), threading.Lock(), threading.Event()
    try:
        for t in fleet.nodes:
            progress(f"starting {t.name} on port {t.port}")
            fleet.start(t)
        workers = [Client(i, seed, fleet, ledger, lock, stop) for i in range(clients)]
        injector = Injector(seed, fleet, ledger, lock, stop, fault_interval, disk=bool(disk_mb))
        t0 = time.monotonic()
        for w in workers:
            w.start()
        injector.start()
        stop.wait(minutes * 60)
        stop.set()
        progress("stopping the clients and the faults")
        injector.join(RECOVERY_BOUND + 120)
        for w in workers:
            w.join(300)
        elapsed = time.monotonic() - t0
        if injector.error:
            raise BenchError(injector.error)
        for t in fleet.nodes:  # a node the last fault left down comes back for the check
            if t.name in fleet.down:
                fleet.start(t)
        first_api = Api(fleet.nodes[0].url, fleet.nodes[0].token)
        for sid, m in (list_sandboxes(first_api) or {}).items():
            if m["state"] == "frozen":  # `runsc list`, which the checker asks, hangs on a frozen sandbox
                first_api.call("POST", f"/api/sandboxes/{sid}/resume", {})
        progress(f"checking the invariants ({len(ledger.sandboxes)} sandboxes tracked)")
        violations: List[Violation] = []
        first = fleet.nodes[0]
        if nodes == 1:
            violations = check(first.url, first.token, first.home, ledger)
        else:  # the ledger through one node (lists span the fleet); each home's leaks against every record
            violations = check(first.url, first.token, first.home, ledger, leaks=False, node=None)
            # runsc is asked about the first node's home only: a runtime alive in another node's is no violation
            elsewhere = {rt for t in fleet.nodes[1:] for rt in runsc_sandboxes(t.home)}
            violations = [v for v in violations if not (v.kind == "runtime" and "is not alive" in v.detail
                                                        and any(rt in v.detail for rt in elsewhere))]
            models = list_sandboxes(Api(first.url, first.token)) or {}
            for t in fleet.nodes:
                violations += check_leaks(t.home, models)
        ops: Dict[str, List[int]] = {}
        errors: Dict[str, List[str]] = {}
        for w in workers:
            for k, seen in w.errors.items():
                errors[k] = (errors.get(k, []) + seen)[:3]
        for w in workers:
            for k, (n, failed) in w.ops.items():
                ops.setdefault(k, [0, 0])
                ops[k][0] += n
                ops[k][1] += failed
        total_ops, total_faults = sum(n for n, _ in ops.values()), sum(injector.injected.values())
        rec = injector.recovery
        return {
            "mode": "chaos", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "seed": seed, "nodes": nodes, "clients": clients, "minutes": round(elapsed / 60, 2),
            "operations": {k: {"run": n, "failed": f} for k, (n, f) in sorted(ops.items())},
            "operations_total": total_ops, "operations_per_minute": round(total_ops / (elapsed / 60), 1),
            "faults": dict(sorted(injector.injected.items())), "faults_total": total_faults,
            "faults_per_minute": round(total_faults / (elapsed / 60), 2),
            "recovery_s": {"n": len(rec), "p50": percentile(rec, 50), "p99": percentile(rec, 99)},
            "recovery_max_s": {k: round(max(v), 1) for k, v in sorted(injector.by_kind.items())},
            "not_recovered": injector.unrecovered,
            "violations": [str(v) for v in violations],
            "errors": errors,
        }
    finally:
        stop.set()
        live = fleet.up()
        if live:  # what the soak made goes with it (the homes are removed with the logs)
            api = Api(live[0].url, live[0].token)
            for sid in list_sandboxes(api) or {}:
                try:
                    api.call("DELETE", f"/api/sandboxes/{sid}")
                except OSError:
                    pass
        fleet.close()


def table(r: dict) -> str:
    lines = [f"chaos soak: seed {r['seed']}, {r['nodes']} node(s), {r['clients']} clients, {r['minutes']} min",
             f"operations: {r['operations_total']} ({r['operations_per_minute']}/min)"]
    lines += [f"  {k:13s} {v['run']:5d} run, {v['failed']:4d} failed" for k, v in r["operations"].items()]
    lines.append(f"faults: {r['faults_total']} ({r['faults_per_minute']}/min): "
                 + ", ".join(f"{k} {n}" for k, n in r["faults"].items()))
    rec = r["recovery_s"]
    fmt = (lambda v: "-" if v is None else f"{v:.1f} s")
    lines.append(f"recovery (fault to each affected sandbox answering): p50 {fmt(rec['p50'])}, "
                 f"p99 {fmt(rec['p99'])} over {rec['n']}")
    if r["recovery_max_s"]:
        lines.append("  slowest per fault: " + ", ".join(f"{k} {v:.1f} s" for k, v in r["recovery_max_s"].items()))
    if r["not_recovered"]:
        lines.append(f"not answering within {RECOVERY_BOUND:g} s: " + "; ".join(r["not_recovered"]))
    lines.append(f"invariant violations: {len(r['violations'])}")
    lines += [f"  {v}" for v in r["violations"]]
    return "\n".join(lines)


def run(args) -> int:
    home = Path(args.home) if args.home else default_home()
    if not 1 <= args.nodes <= 3:
        print("sandgate bench: --nodes is 1, 2 or 3", file=sys.stderr)
        return 2
    if args.minutes <= 0:
        print("sandgate bench: --minutes must be above 0", file=sys.stderr)
        return 2
    logdir = Path(tempfile.mkdtemp(prefix="sandgate-bench-chaos-"))
    failed, report = None, {}
    try:
        preflight(home)
        seed = args.seed if args.seed is not None else random.randrange(1 << 30)
        progress(f"chaos soak: seed {seed}, {args.nodes} node(s), {args.minutes:g} min (logs {logdir})")
        report = soak(home, logdir, args.minutes, seed, args.nodes, args.chaos_clients, args.chaos_fault_interval,
                      args.chaos_disk_mb)
    except BenchError as e:
        failed = str(e)
    except KeyboardInterrupt:
        failed = "interrupted"
    if report.get("violations"):  # the gateways' logs outlive the run that found something
        kept = Path(tempfile.mkdtemp(prefix=f"sandgate-chaos-{report['seed']}-logs-"))
        for log in logdir.glob("*.log"):
            shutil.copy(log, kept)
        report["logs"] = str(kept)
        print(f"gateway logs kept in {kept}", file=sys.stderr)
    return conclude(failed, logdir, args.output, report, table)
