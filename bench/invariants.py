"""What must hold of a gateway after anything died: one checker for the fault walk
(tests/test_fault_walk.py), the chaos soak and CI.

The client that drives the gateway keeps a ``Ledger`` of what it was told
(acknowledged) and what it only asked (in doubt); ``check`` then asks the gateway
(URL and admin token) and looks at its home and the host, and returns the
violations found, empty when all is well. Run it when no request is in flight:
a checkpoint being written looks like a partial one, a start like a leak.

Usage::

    from sandgate_bench.invariants import COUNTER_CELL, Ledger, check

    ledger = Ledger()
    ledger.created(sid)
    ledger.sent(sid)                      # before each run of COUNTER_CELL
    ledger.acked(sid, int(out.stdout))    # its answer; or ledger.unanswered(sid) on an error
    ledger.checkpointed(sid, cid)         # an acknowledged checkpoint (201)
    ledger.deleted(sid)                   # an acknowledged delete (204)
    problems = check(url, token, home, ledger)
    assert not problems, "\\n".join(map(str, problems))

The counter: ``COUNTER_CELL`` increments a variable in the kernel's memory and
prints it. Each sandbox's possible values are kept as intervals (sent but not
answered executes may or may not have run); an answer or a read collapses them.
A value no interval allows is a violation ("ran twice", "went back"), unless a
checkpoint of that sandbox (or the one it was forked from) allows it and the
gateway says the sandbox was restored from that very checkpoint (its ``reason``
or ``resume_from`` names it): the one loss the gateway may have, and says.

What ``check`` reports (``Violation.kind``):

* ``counter``: a sandbox's counter is not what its acknowledged executes make it;
* ``lost``: a sandbox the ledger knows is gone without a delete, or dead when acknowledged state was in
  its memory (its counter cannot be 0: no restart was asked);
* ``deleted``: an acknowledged delete that came back;
* ``checkpoint``: an acknowledged checkpoint that is missing or does not restore
  to its counter (``restore=True`` starts a sandbox from each, then deletes it);
* ``transient``: a sandbox left in a transient state (starting, checkpointing, ...);
* ``runtime``: a state the runtime does not match (running without a live runtime,
  paused or dead with one, two runtimes for one sandbox);
* ``store``: the session store and the gateway's answer disagree;
* ``leak``: what no record owns: runsc sandboxes, shims, qemu processes, cgroups,
  loop devices, mounts, workspace images, state and paused directories, socket
  directories, unfinished or unneeded checkpoints, chunks and blobs.

The API above (``Ledger``'s methods, ``check``'s arguments, ``Violation``'s fields,
``COUNTER_CELL``/``READ_CELL``) is kept stable for the soak and CI.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sqlite3
import subprocess
import tempfile
import urllib.error
import urllib.request
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Set, Tuple

COUNTER = "_sg_counter"
# Increments the counter in the kernel's memory and prints the new value.
COUNTER_CELL = f"{COUNTER} = globals().get('{COUNTER}', 0) + 1\nprint({COUNTER})"
# Prints it without changing it.
READ_CELL = f"print(globals().get('{COUNTER}', 0))"

TRANSIENT = ("starting", "checkpointing", "pausing", "resuming", "restarting")
CHECKPOINT_NAMED = re.compile(r"checkpoint ([0-9a-zA-Z_-]+)")

Interval = Tuple[int, int]


@dataclasses.dataclass(frozen=True)
class Violation:
    kind: str  # counter, lost, deleted, checkpoint, transient, runtime, store, leak
    detail: str
    sandbox: Optional[str] = None

    def __str__(self) -> str:
        return f"{self.kind}: " + (f"sandbox {self.sandbox}: " if self.sandbox else "") + self.detail


@dataclasses.dataclass
class Tracked:
    """One sandbox as its client knows it."""

    ranges: List[Interval]  # what the counter may be now
    pending: int = 0  # executes sent, not yet answered either way
    checkpoints: Dict[str, List[Interval]] = dataclasses.field(default_factory=dict)
    origin: Optional[str] = None  # the checkpoint it was forked from
    deleted: Optional[bool] = None  # True: acknowledged; False: asked, not acknowledged
    restored: Set[str] = dataclasses.field(default_factory=set)  # checkpoints it was seen restored from
    last_value: Optional[int] = None


def _widen(ranges: List[Interval], extra: int) -> List[Interval]:
    return [(lo, hi + extra) for lo, hi in ranges]


def _within(ranges: List[Interval], v: int) -> bool:
    return any(lo <= v <= hi for lo, hi in ranges)


def _merge(ranges: Iterable[Interval]) -> List[Interval]:
    out: List[Interval] = []
    for lo, hi in sorted(set(ranges)):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(hi, out[-1][1]))
        else:
            out.append((lo, hi))
    return out


def _show(ranges: List[Interval]) -> str:
    return " or ".join(str(lo) if lo == hi else f"{lo}..{hi}" for lo, hi in ranges)


class Ledger:
    """What a client was told. Every method takes the sandbox id; none talks to the gateway.
    Problems seen as answers arrive (a value that nothing explains) are kept in ``problems``
    and returned by ``check`` with the rest."""

    def __init__(self) -> None:
        self.sandboxes: Dict[str, Tracked] = {}
        self.checkpoint_of: Dict[str, str] = {}  # checkpoint id -> sandbox id
        self.problems: List[Violation] = []
        self.claims: Dict[str, str] = {}  # sandbox -> checkpoint a value was explained by, for check to confirm

    def created(self, sid: str) -> None:
        self.sandboxes[sid] = Tracked(ranges=[(0, 0)])

    def forked(self, sid: str, cid: str) -> None:
        """Started from checkpoint ``cid`` (a fork, or a create with ``checkpoint``)."""
        src = self.checkpoint_ranges(cid)
        self.sandboxes[sid] = Tracked(ranges=list(src or [(0, 0)]), origin=cid)

    def sent(self, sid: str) -> None:
        """A COUNTER_CELL is about to be sent: from now on it may have run."""
        t = self.sandboxes[sid]
        t.pending += 1
        t.ranges = _widen(t.ranges, 1)

    def acked(self, sid: str, value: int) -> None:
        """A COUNTER_CELL answered, printing ``value``."""
        t = self.sandboxes[sid]
        t.pending = max(0, t.pending - 1)
        self._observe(sid, value)

    def unanswered(self, sid: str) -> None:
        """A COUNTER_CELL got no answer (an error, a lost connection): it may or may not have run."""
        t = self.sandboxes[sid]
        t.pending = max(0, t.pending - 1)

    def checkpointed(self, sid: str, cid: str) -> None:
        """An acknowledged checkpoint: the counter then is one of the values it may be now."""
        t = self.sandboxes[sid]
        t.checkpoints[cid] = list(t.ranges)
        self.checkpoint_of[cid] = sid

    def checkpoint_deleted(self, cid: str) -> None:
        sid = self.checkpoint_of.pop(cid, None)
        if sid in self.sandboxes:
            self.sandboxes[sid].checkpoints.pop(cid, None)

    def restarted(self, sid: str, acknowledged: bool = True) -> None:
        """A restart (a new kernel: the counter starts again); unacknowledged, it may not have happened."""
        t = self.sandboxes[sid]
        t.ranges = _merge([(0, 0)] + ([] if acknowledged else t.ranges))

    def deleted(self, sid: str, acknowledged: bool = True) -> None:
        t = self.sandboxes[sid]
        t.deleted = True if acknowledged or t.deleted else False

    def exact(self, sid: str) -> Optional[int]:
        """The counter if the ledger knows it exactly (nothing in doubt), else None."""
        r = self.sandboxes[sid].ranges
        return r[0][0] if len(r) == 1 and r[0][0] == r[0][1] else None

    def checkpoint_ranges(self, cid: str) -> Optional[List[Interval]]:
        sid = self.checkpoint_of.get(cid)
        return self.sandboxes[sid].checkpoints.get(cid) if sid in self.sandboxes else None

    def restorable(self, sid: str) -> Dict[str, List[Interval]]:
        """The checkpoints a restore of ``sid`` may come from: its own, and its origin."""
        t = self.sandboxes[sid]
        out = dict(t.checkpoints)
        origin = self.checkpoint_ranges(t.origin) if t.origin else None
        if origin:
            out[t.origin] = origin
        return out

    def _observe(self, sid: str, value: int) -> None:
        """An answer: the counter is ``value`` just after one more increment."""
        t = self.sandboxes[sid]
        t.last_value = value
        if _within([(lo + 1, hi) for lo, hi in t.ranges], value):
            t.ranges = [(value, value + t.pending)]
            return
        # Not what the executes make it: only a restore from one of its checkpoints explains it,
        # which the gateway must then say (check confirms the claim).
        for cid, ranges in self.restorable(sid).items():
            if _within([(lo + 1, hi + 1 + t.pending) for lo, hi in ranges], value):
                self.claims[sid] = cid
                t.ranges = [(value, value + t.pending)]
                return
        self.problems.append(Violation("counter", f"an execute printed {value} where the acknowledged executes "
                                       f"allow {_show([(lo + 1, hi) for lo, hi in t.ranges])} and no checkpoint "
                                       "explains it", sid))
        t.ranges = [(value, value + t.pending)]


# -- talking to the gateway ------------------------------------------------------------------
class Api:
    """The few calls the checker makes, with the standard library."""

    def __init__(self, url: str, token: str, timeout: float = 120.0):
        self.url, self.token, self.timeout = url.rstrip("/"), token, timeout

    def call(self, method: str, path: str, body: Optional[dict] = None) -> Tuple[int, object]:
        req = urllib.request.Request(self.url + path, method=method,
                                     data=json.dumps(body).encode() if body is not None else None,
                                     headers={"Authorization": f"token {self.token}",
                                              "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout + 30) as r:
                raw = r.read()
                return r.status, json.loads(raw) if raw else None
        except urllib.error.HTTPError as e:
            raw = e.read()
            try:
                return e.code, json.loads(raw)
            except ValueError:
                return e.code, raw.decode(errors="replace")

    def read_counter(self, sid: str, tries: int = 3) -> Tuple[Optional[int], str]:
        """READ_CELL in ``sid`` (a paused one resumes): the counter, or why not. A 503 (a resume
        that failed, the sandbox still paused) is asked again, ``tries`` times in all."""
        for _ in range(tries):
            code, out = self.call("POST", f"/api/sandboxes/{sid}/execute", {"code": READ_CELL, "timeout": self.timeout})
            if code != 503:
                break
        if code != 200 or not isinstance(out, dict):
            return None, f"{code} {out}"
        try:
            return int((out.get("stdout") or "").strip()), ""
        except ValueError:
            return None, f"read {out.get('stdout')!r} (error {out.get('error')})"


def check(url: str, token: str, home: Path, ledger: Optional[Ledger] = None, *, read: bool = True,
          restore: bool = True, leaks: bool = True, allow_pool: bool = False, node: Optional[str] = None,
          timeout: float = 120.0) -> List[Violation]:
    """Every invariant, against the gateway at ``url`` (admin ``token``) whose home is ``home``.
    ``read``: run READ_CELL in each sandbox the ledger knows (this resumes paused ones);
    ``restore``: start a sandbox from each acknowledged checkpoint and read its counter;
    ``leaks``: look for what no record owns on the host; ``allow_pool``: runtimes and state
    directories of warm-pool sandboxes (no record) are not leaks; ``node``: this node's name
    in a shared store (default: every record in the home's SQLite store)."""
    home = Path(home)
    ledger = ledger or Ledger()
    api = Api(url, token, timeout)
    out: List[Violation] = list(ledger.problems)
    models = list_sandboxes(api)
    if models is None:
        return out + [Violation("store", "GET /api/sandboxes did not answer 200")]
    out += check_states(models, store_records(home, node), home)
    out += check_ledger(api, ledger, models, read=read)
    if restore:
        out += check_checkpoints(api, ledger, models)
    if leaks:
        out += check_leaks(home, list_sandboxes(api) or models, allow_pool=allow_pool)  # after reads and restores
    return out


def list_sandboxes(api: Api) -> Optional[Dict[str, dict]]:
    code, listed = api.call("GET", "/api/sandboxes")
    if code != 200 or not isinstance(listed, list):
        return None
    return {m["id"]: m for m in listed}


def store_records(home: Path, node: Optional[str] = None) -> Optional[Dict[str, dict]]:
    """The records of the home's SQLite store (None: there is none, e.g. a Redis store)."""
    db = Path(home) / "sessions.db"
    if not db.is_file():
        return None
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
    try:
        rows = con.execute("SELECT id, node, state, record FROM sandboxes").fetchall()
    finally:
        con.close()
    out = {}
    for sid, n, state, raw in rows:
        if node is not None and n != node:
            continue
        try:
            rec = json.loads(raw)
        except ValueError:
            rec = {}
        out[sid] = {**rec, "state": state}
    return out


def check_states(models: Dict[str, dict], records: Optional[Dict[str, dict]], home: Path) -> List[Violation]:
    """No transient state; store and answer agree; each state matches its runtime."""
    out: List[Violation] = []
    live = runsc_sandboxes(home)
    for sid, m in models.items():
        st, rt = m["state"], m.get("runtime_id")
        if st in TRANSIENT:
            out.append(Violation("transient", f"left {st}", sid))
        if records is not None:
            rec = records.get(sid)
            if rec is None:
                out.append(Violation("store", f"listed as {st} but the store has no record", sid))
            elif rec["state"] != st:
                out.append(Violation("store", f"listed as {st} but the store says {rec['state']}", sid))
            elif (rec.get("runtime") or None) != rt:
                out.append(Violation("store", f"runtime {rt} listed, {rec.get('runtime')} in the store", sid))
        if m.get("driver") == "gvisor":
            alive = rt is not None and live.get(rt) in ("running", "paused", "created")
        else:
            alive = rt is not None and qemu_alive(home, rt)
        if st in ("running", "frozen") and not alive:
            out.append(Violation("runtime", f"{st} but its runtime {rt} is not alive "
                                 f"(runsc says {live.get(rt) if rt else 'nothing'})", sid))
        if st in ("paused", "dead") and rt is not None:
            out.append(Violation("runtime", f"{st} but it still names runtime {rt}", sid))
        others = [r for r in live if r.startswith(f"sg-{sid}-") and r != rt]
        if others:
            out.append(Violation("runtime", f"{st} with runtime {rt}, but runsc also has {others}", sid))
    if records is not None:
        for sid, rec in records.items():
            if sid not in models:
                out.append(Violation("store", f"the store has a {rec['state']} record the gateway does not list", sid))
    return out


def check_ledger(api: Api, ledger: Ledger, models: Dict[str, dict], read: bool = True) -> List[Violation]:
    """Each sandbox the client knows: deleted stays deleted, the rest are there with their counter."""
    out: List[Violation] = []
    for sid, t in ledger.sandboxes.items():
        m = models.get(sid)
        if t.deleted:
            if m is not None:
                out.append(Violation("deleted", f"deleted (acknowledged) but listed as {m['state']}", sid))
            code, _ = api.call("GET", f"/api/sandboxes/{sid}")
            if code != 404:
                out.append(Violation("deleted", f"deleted (acknowledged) but GET answers {code}", sid))
            continue
        if m is None:
            if t.deleted is None:
                out.append(Violation("lost", "gone without a delete", sid))
            continue
        named = set(CHECKPOINT_NAMED.findall(m.get("reason") or ""))
        if m.get("resume_from"):
            named.add(m["resume_from"])
        claim = ledger.claims.pop(sid, None)
        if claim and claim not in named:
            out.append(Violation("counter", f"its counter went back to checkpoint {claim}'s, but the gateway does "
                                 f"not say it was restored from it (reason: {m.get('reason')!r})", sid))
        if m["state"] == "dead":
            if not _within(t.ranges, 0):  # 0: nothing acknowledged was in its memory (or a restart was asked)
                out.append(Violation("lost", f"dead ({m.get('reason')}) with acknowledged state "
                                     f"(counter {_show(t.ranges)})", sid))
            continue
        if not read:
            continue
        value, why = api.read_counter(sid)
        if value is None:
            out.append(Violation("counter", f"could not be read: {why}", sid))
            continue
        if not _within(t.ranges, value):
            explained = [cid for cid, r in ledger.restorable(sid).items()
                         if cid in named and _within(_widen(r, t.pending), value)]
            if explained:
                t.restored.add(explained[0])
            else:
                out.append(Violation("counter", f"the counter is {value}; the acknowledged executes make it "
                                     f"{_show(t.ranges)}" + (f", and the gateway says it was restored from "
                                                             f"{sorted(named)}" if named else ""), sid))
        t.ranges, t.last_value = [(value, value + t.pending)], value
    return out


def check_checkpoints(api: Api, ledger: Ledger, models: Dict[str, dict]) -> List[Violation]:
    """Every acknowledged checkpoint of a sandbox still there restores, with its counter
    (a deleted sandbox's checkpoints are collected with it, by design)."""
    out: List[Violation] = []
    for sid, t in ledger.sandboxes.items():
        if t.deleted is not None or sid not in models:
            continue
        for cid, ranges in t.checkpoints.items():
            code, made = api.call("POST", "/api/sandboxes", {"checkpoint": cid})
            if code != 201 or not isinstance(made, dict):
                out.append(Violation("checkpoint", f"checkpoint {cid} does not restore: {code} {made}", sid))
                continue
            try:
                value, why = api.read_counter(made["id"])
                if value is None:
                    out.append(Violation("checkpoint", f"checkpoint {cid} restored but not readable: {why}", sid))
                elif not _within(ranges, value):
                    out.append(Violation("checkpoint", f"checkpoint {cid} restores with counter {value}, taken at "
                                         f"{_show(ranges)}", sid))
            finally:
                code, _ = api.call("DELETE", f"/api/sandboxes/{made['id']}")
                if code != 204:
                    out.append(Violation("checkpoint", f"the sandbox restored from {cid} could not be deleted: {code}"))
    return out


# -- the host --------------------------------------------------------------------------------
def runsc_sandboxes(home: Path) -> Dict[str, str]:
    """runsc's sandboxes under the home's runtime root: id -> status (running, paused, created, or
    stopped when its process is gone). Read from runsc's own records, not `runsc list`, which
    waits on every sandbox and so hangs on a frozen one."""
    root = Path(home) / "runtime" / "gvisor"
    out: Dict[str, str] = {}
    for f in root.glob("sg-*.state") if root.is_dir() else ():
        try:
            rec = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        pid = (rec.get("sandbox") or {}).get("pid")
        out[rec.get("id") or f.name.split("_sandbox:")[0]] = rec.get("status") if _alive(pid) else "stopped"
    return out


def _alive(pid) -> bool:
    """Whether ``pid`` is a live process (not a zombie)."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _tag(text: str) -> str:
    from sandgate.drivers.base import tag  # the name the drivers give a runtime's socket directory

    return tag(text)


def _processes() -> List[Tuple[int, str]]:
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if cmd:
                out.append((int(p.name), cmd))
    return out


def qemu_alive(home: Path, runtime: str) -> bool:
    d = f"sgq-{_tag(str(home))}-{_tag(runtime)}"
    return any("qemu-system" in cmd and d in cmd for _, cmd in _processes())


def check_leaks(home: Path, models: Dict[str, dict], allow_pool: bool = False) -> List[Violation]:
    """What no record owns, on the host and in the home."""
    home = Path(home)
    out: List[Violation] = []
    ids = set(models)
    runtimes = {m["runtime_id"] for m in models.values() if m.get("runtime_id")}
    state_dirs = {p.name for p in (home / "sandboxes").iterdir()} if (home / "sandboxes").is_dir() else set()
    # Warm-pool sandboxes have no record: their runtime is named after their own state directory.
    pool = state_dirs - ids if allow_pool else set()
    owners = ids | pool

    def owned(runtime: str) -> bool:
        return runtime in runtimes or any(runtime.startswith(f"sg-{p}-") for p in pool)

    live = runsc_sandboxes(home)
    for rt, status in live.items():
        if not owned(rt) and status != "stopped":
            out.append(Violation("leak", f"runsc sandbox {rt} ({status}) that no record owns"))
    tag = _tag(str(home))
    own_dirs = {f"sg{k}-{tag}-{_tag(rt)}" for rt in runtimes | {r for r in live if owned(r)} for k in "gq"}
    for pid, cmd in _processes():
        for kind, what, marker in (("g", "shim", "shim"), ("q", "qemu", "qemu-system")):
            m = re.search(rf"sg{kind}-{tag}-[0-9a-f]+", cmd)
            if m and marker in cmd and m.group(0) not in own_dirs:
                out.append(Violation("leak", f"{what} process {pid} of a runtime no record owns ({m.group(0)})"))
    for d in Path(tempfile.gettempdir()).glob(f"sg[gq]-{tag}-*"):
        if d.name not in own_dirs:
            out.append(Violation("leak", f"runtime socket directory {d} that no record owns"))
    prefixes = tuple(f"sg-{i}-" for i in owners)
    for cg in [*Path("/sys/fs/cgroup").glob("*/sandgate"), Path("/sys/fs/cgroup/sandgate")]:
        for d in cg.iterdir() if cg.is_dir() else ():
            # Only this home's: a runtime runsc lists, or one named after a sandbox of it.
            if d.is_dir() and (d.name in live or d.name.startswith(prefixes)) and not owned(d.name):
                out.append(Violation("leak", f"cgroup {d} of runtime {d.name} that no record owns"))
    wsroot = str(home / "workspaces") + "/"
    try:
        mounts = [line.split()[4].replace("\\040", " ")
                  for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    except OSError:
        mounts = []
    for mp in mounts:
        if mp.startswith(wsroot) and mp[len(wsroot):].split("/")[0].removesuffix(".img") not in owners:
            out.append(Violation("leak", f"mount {mp} that no record owns"))
    try:
        r = subprocess.run(["losetup", "-J", "-l"], capture_output=True, text=True, timeout=30)
        loops = json.loads(r.stdout or "{}").get("loopdevices", [])
    except (OSError, ValueError, subprocess.TimeoutExpired):
        loops = []
    for lo in loops:
        f = lo.get("back-file") or ""
        if f.startswith(wsroot):
            name = Path(f.split(" (deleted)")[0]).name.removesuffix(".img")
            if name not in owners or "(deleted)" in f:
                out.append(Violation("leak", f"loop device {lo.get('name')} on {f} that no record owns"))
    for sub in ("workspaces", "sandboxes"):
        d = home / sub
        for p in d.iterdir() if d.is_dir() else ():
            if p.name.removesuffix(".img") not in owners:
                out.append(Violation("leak", f"{sub}/{p.name} that no record owns"))
    paused_ok = {i for i, m in models.items() if m["state"] == "paused"}
    d = home / "paused"
    for p in d.iterdir() if d.is_dir() else ():
        if p.name not in paused_ok:
            out.append(Violation("leak", f"paused image paused/{p.name} that no paused record owns"))
    return out + checkpoint_leaks(home, models)


def checkpoint_leaks(home: Path, models: Dict[str, dict]) -> List[Violation]:
    """Unfinished checkpoint directories; checkpoints no sandbox's line needs (what the
    gateway's gc keeps: those of live sandboxes, their origin, head and resume point, the
    pool's templates, and their ancestors); chunks and blobs no checkpoint uses."""
    from sandgate.checkpoints import blob_key
    from sandgate.checkpoints.state_chunks import manifest_keys

    root = Path(home) / "checkpoints"
    items = root / "items"
    if not items.is_dir():
        return []
    out: List[Violation] = []
    cps: Dict[str, dict] = {}
    for d in items.iterdir():
        try:
            cps[d.name] = json.loads((d / "checkpoint.json").read_text())
        except FileNotFoundError:
            out.append(Violation("leak", f"unfinished checkpoint directory checkpoints/items/{d.name}"))
        except (OSError, ValueError) as e:
            out.append(Violation("leak", f"checkpoint {d.name} has an unreadable record: {e}"))
    try:
        templates = set(json.loads((Path(home) / "templates.json").read_text()).values())
    except (OSError, ValueError):
        templates = set()
    keep = {c for c, cp in cps.items() if cp.get("sandbox") in models}
    keep |= {m.get(k) for m in models.values() for k in ("head", "resume_from")} | templates
    keep |= {(m.get("parent") or {}).get("checkpoint") for m in models.values()}
    keep &= set(cps)
    frontier = list(keep)
    while frontier:
        parent = cps[frontier.pop()].get("parent")
        if parent in cps and parent not in keep:
            keep.add(parent)
            frontier.append(parent)
    for c in sorted(set(cps) - keep):
        out.append(Violation("leak", f"checkpoint {c} (of sandbox {cps[c].get('sandbox')}) that no sandbox needs"))
    chunks: Set[str] = set()
    blobs: Set[str] = set()
    for c, cp in cps.items():
        try:
            chunks.update(manifest_keys(items / c / "state"))
        except ValueError:
            pass
        blobs.update(blob_key(cp.get("owner", ""), f["sha256"]) for f in (cp.get("files") or {}).values()
                     if f.get("sha256"))
    for kind, have in (("chunks", chunks), ("blobs", blobs)):
        d = root / kind
        extra = [p.name for p in d.glob("*/*") if p.name.split(".tmp-")[0] not in have] if d.is_dir() else []
        if extra:
            out.append(Violation("leak", f"{len(extra)} checkpoint {kind} no checkpoint uses "
                                 f"(e.g. {kind}/{extra[0][:2]}/{extra[0]})"))
    return out


__all__ = ["COUNTER_CELL", "READ_CELL", "Api", "Ledger", "Violation", "check", "check_checkpoints", "check_leaks",
           "check_ledger", "check_states", "checkpoint_leaks", "list_sandboxes", "qemu_alive", "runsc_sandboxes",
           "store_records"]
