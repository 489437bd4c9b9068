"""Every fault point of every operation, walked once with real sandboxes (gateway/faults.py):
a gateway on one home runs an operation with the point set to SIGKILL it, the next gateway
on that home recovers, and the invariant checker (bench/invariants.py) finds nothing wrong:
every acknowledged cell ran once, nothing is left in a transient state, nothing leaks, no
sandbox lost its memory. Then every ``fail`` point, all in one gateway's life: each call
that fails leaves the sandbox as the checker wants it. The points come from
``faults.points()``: one added later is walked here with no new code; an operation with
no scenario below fails the test."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

import pytest

from conftest import Gateway, wait_for
from sandgate import faults
from sandgate.app import make_service  # noqa: F401  (imports the core: every point declared)
from sandgate_bench.invariants import COUNTER_CELL, Ledger, Violation, check

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

ENV = {"SANDGATE_KEEP_SANDBOXES": "true", "SANDGATE_WARM_START": "false"}
# Operations a single node cannot run: a drain hands sandboxes to another node (test_fleet.py).
NOT_HERE = {"drain": "a drain needs a fleet"}
# Points only a driver that checkpoints in place passes, and those only one that cannot does.
IN_PLACE_ONLY = {"checkpoint/driver.checkpoint_in_place", "checkpoint/driver.checkpoint_in_place.done",
                 "checkpoint/driver.unpause"}
# Points only a failure leads to, which the fail walk reaches and a kill walk's scenario does not: a
# restart recreates the runtime only when the in-place one fails; a recovery keeps an image only for
# a record a kill left checkpointing after its runtime stopped (the checkpoint's kill points make that
# state, and the next gateway, unarmed, passes it).
ONLY_AFTER_A_FAILURE = {"restart/driver.create", "restart/driver.create.done", "recover/files.image.keep"}
STOP_ONLY = {"checkpoint/driver.checkpoint", "checkpoint/driver.checkpoint.done", "checkpoint/driver.restore",
             "checkpoint/driver.restore.done", "checkpoint/agent.reconnect", "checkpoint/runtime.destroy",
             "checkpoint/runtime.destroy.done"}


class Walk:
    """One home, one sandbox the walk keeps (``main``), the client's ledger."""

    def __init__(self, home: Path, tmp: Path, env: dict):
        self.images, self.tmp, self.env = home, tmp, env
        self.home: Optional[Path] = None
        self.ledger = Ledger()
        self.main = ""
        self.g: Optional[Gateway] = None

    # -- gateways on the walk's home ------------------------------------------------
    def start(self, fault: str = "") -> Optional[Gateway]:
        """A gateway on the home (``fault``: SANDGATE_FAULT); None if it died before it answered."""
        env = {**self.env, **({"SANDGATE_FAULT": fault} if fault else {})}
        for _ in range(3):
            try:
                self.g = Gateway(self.images, self.tmp, own_home=self.home, env=env)
            except RuntimeError:
                self.g = None  # killed (or failed) during its recovery: the log says which
                break
            # Another test's gateway may have taken the free port first and answered for ours.
            mine = f"serving at {self.g.url}"
            wait_for(lambda: mine in self.g.log_text() or self.g.proc.poll() is not None, timeout=60)
            if mine in self.g.log_text():
                break
            self.g.stop()
        if self.home is None and self.g:
            self.home = self.g.home
        return self.g

    def kill(self) -> None:
        if self.g and self.g.proc.poll() is None:
            self.g.proc.send_signal(signal.SIGKILL)
            self.g.proc.wait()
        if self.g:
            self.g.log.close()

    def died(self, timeout: float = 120) -> bool:
        """Whether the gateway was SIGKILLed by its fault (waits for it, bounded)."""
        try:
            return self.g.proc.wait(timeout) == -signal.SIGKILL
        except subprocess.TimeoutExpired:
            return False

    # -- what the client does --------------------------------------------------------
    def call(self, method: str, path: str, body=None, timeout: float = 300):
        """One request; (status, json) or (None, None) if the gateway went away meanwhile."""
        try:
            r = self.g.request(method, path, body, timeout=timeout)
        except OSError:
            return None, None
        try:
            return r.status, r.json() if r.body else None
        except ValueError:
            return r.status, None

    def count(self, sid: str) -> None:
        self.ledger.sent(sid)
        code, out = self.call("POST", f"/api/sandboxes/{sid}/execute", {"code": COUNTER_CELL, "timeout": 60})
        if code == 200 and out.get("status") == "ok" and out.get("stdout", "").strip().isdigit():
            self.ledger.acked(sid, int(out["stdout"]))
        else:
            self.ledger.unanswered(sid)

    def create(self) -> Optional[str]:
        code, out = self.call("POST", "/api/sandboxes", {})
        if code != 201:
            return None
        self.ledger.created(out["id"])
        return out["id"]

    def state(self, sid: str) -> Optional[str]:
        code, out = self.call("GET", f"/api/sandboxes/{sid}")
        return out["state"] if code == 200 else None

    def running(self, sid: str) -> None:
        """Make sure ``sid`` runs (resumed if paused or frozen) before an operation."""
        if self.state(sid) in ("paused", "frozen"):
            self.call("POST", f"/api/sandboxes/{sid}/resume")

    def checkpoint(self, sid: str) -> Optional[str]:
        code, out = self.call("POST", f"/api/sandboxes/{sid}/checkpoints", {})
        if code == 201:
            self.ledger.checkpointed(sid, out["id"])
            return out["id"]
        return None

    def delete(self, sid: str) -> None:
        code, _ = self.call("DELETE", f"/api/sandboxes/{sid}")
        self.ledger.deleted(sid, acknowledged=code == 204)

    def pause(self, sid: str, mode: str) -> None:
        self.call("POST", f"/api/sandboxes/{sid}/pause", {"mode": mode})

    def restart(self, sid: str) -> None:
        code, _ = self.call("POST", f"/api/kernels/{sid}/restart", {})
        self.ledger.restarted(sid, acknowledged=code == 200)

    def violations(self, **kw) -> List[Violation]:
        return check(self.g.url, self.g.token, self.home, self.ledger, **kw)

    def finish(self, found: Dict[str, List[str]], unreached: List[str], what: str, t0: float) -> None:
        """The final check (every checkpoint restored too), the walk's time, and what it found."""
        self.running(self.main)
        problems = self.violations(restore=True)
        if problems:
            found["(final)"] = [str(v) for v in problems]
        print(f"fault walk: {what} in {time.monotonic() - t0:.0f} s", file=sys.stderr)
        self.g.stop()
        assert not unreached, f"points their operation's scenario did not reach: {unreached}"
        assert not found, "\n".join(f"{p}: {v}" for p, vs in found.items() for v in vs)


# One scenario per operation: from a running ``main``, the operation once (and what it needs
# first, through other operations). A gateway killed midway makes every later call fail.
def _start(w: Walk) -> None:
    sid = w.create()
    if sid:
        w.count(sid)
        w.delete(sid)


def _checkpoint(w: Walk) -> None:
    w.count(w.main)
    w.checkpoint(w.main)
    w.count(w.main)


def _fork(w: Walk) -> None:
    cid = w.checkpoint(w.main)
    if cid is None:
        return
    code, out = w.call("POST", f"/api/sandboxes/{w.main}/fork", {"checkpoint": cid})
    if code == 201:
        w.ledger.forked(out["id"], cid)
        w.count(out["id"])
        w.delete(out["id"])


def _pause_disk(w: Walk) -> None:
    w.count(w.main)
    w.pause(w.main, "disk")


def _pause_memory(w: Walk) -> None:
    w.count(w.main)
    w.pause(w.main, "memory")


def _resume(w: Walk) -> None:
    for mode in ("disk", "memory"):
        w.count(w.main)
        w.pause(w.main, mode)
        w.call("POST", f"/api/sandboxes/{w.main}/resume")
        w.count(w.main)


def _restart(w: Walk) -> None:
    w.count(w.main)
    w.restart(w.main)
    w.count(w.main)


def _delete(w: Walk) -> None:
    sid = w.create()
    if sid:
        w.count(sid)
        w.checkpoint(sid)  # something for the delete's collection to remove
        w.delete(sid)


SCENARIOS: Dict[str, Callable[[Walk], None]] = {
    "start": _start, "checkpoint": _checkpoint, "fork": _fork, "pause_disk": _pause_disk,
    "pause_memory": _pause_memory, "resume": _resume, "restart": _restart, "delete": _delete, "gc": _delete,
}


def walked(in_place: bool) -> List[str]:
    """The points to walk; SANDGATE_WALK_POINTS (comma-separated prefixes, e.g. "checkpoint/,recover/")
    walks only those, to reproduce one."""
    skip = STOP_ONLY if in_place else IN_PLACE_ONLY
    only = tuple(filter(None, os.environ.get("SANDGATE_WALK_POINTS", "").split(",")))
    return [p for p in faults.points() if p not in skip and p.split("/")[0] not in NOT_HERE
            and (not only or p.startswith(only))]


def test_every_operation_with_points_has_a_scenario():
    ops = {p.split("/")[0] for p in faults.points()}
    assert ops - set(SCENARIOS) - {"recover"} - set(NOT_HERE) == set()


def _checks_on(point: str) -> bool:
    """Whether a gateway armed at ``point`` can recover and be checked before its operation runs:
    the checker's reads resume paused sandboxes, and a recovery point acts during the recovery."""
    return point.split("/")[0] not in ("resume", "recover")


@pytest.mark.parametrize("variant", ["gvisor"])
def test_a_gateway_killed_at_any_fault_point_loses_nothing(variant, home, tmp_path):
    from sandgate_images import runsc

    env = dict(ENV)
    in_place = variant == "gvisor-runsc-trixie"
    if in_place:
        env["SANDGATE_RUNSC"] = str(runsc.fetch(home))
    w = Walk(home, tmp_path, env)
    w.start()
    w.main = w.create()
    w.count(w.main)
    found: Dict[str, List[str]] = {}
    unreached: List[str] = []
    t0 = time.monotonic()
    points = walked(in_place)
    points = [p for p in points if p not in ONLY_AFTER_A_FAILURE]
    ops = [p for p in points if not p.startswith("recover/")]
    armed = ""  # the point the live gateway is armed at

    def recovered(p: str, following: Optional[str]) -> None:
        """After ``p``'s kill: the next gateway (armed at ``following`` where that is safe), and the checker."""
        nonlocal armed
        armed = following if following and _checks_on(following) else ""
        w.start(f"{armed}:kill" if armed else "")
        assert w.g is not None, f"after {p}: the gateway did not start"
        problems = w.violations(restore=False)
        if problems:
            found[p] = [str(v) for v in problems]
            print(f"{p}: {found[p]}", file=sys.stderr)

    for i, p in enumerate(ops):
        if armed != p:
            w.kill()  # killed idle: its sandboxes are adopted by the next
            w.start(f"{p}:kill")
            assert w.g is not None, f"{p}: the gateway did not start"
        w.running(w.main)
        SCENARIOS[p.split("/")[0]](w)
        if not w.died():
            unreached.append(p)
            w.kill()
        recovered(p, ops[i + 1] if i + 1 < len(ops) else None)
    # Recovery itself, killed at each of its points: the sandboxes it was bringing back, again.
    for p in [p for p in points if p.startswith("recover/")]:
        w.running(w.main)
        w.pause(w.main, "memory")  # one adopted frozen,
        other = w.create()  # one running, one paused to disk
        if other:
            w.count(other)
            w.pause(other, "disk")
        w.kill()
        w.start(f"{p}:kill")
        if w.g is not None:  # it came up: the point was not reached
            unreached.append(p)
            w.kill()
        recovered(p, None)
        if other:
            w.delete(other)
    w.finish(found, unreached, f"{len(points)} kill points ({variant})", t0)


FAILED = "fault point {}: failing the call"


def test_every_call_that_fails_at_a_fault_point_leaves_nothing_wrong(home, tmp_path):
    """All the ``fail`` points at once, in one gateway: each operation runs until it no longer
    meets a failure (each point fails once), the checker after each try."""
    points = [p for p in walked(False) if p in faults.points(failing=True) and not p.startswith("recover/")]
    w = Walk(home, tmp_path, ENV)
    w.start()
    w.main = w.create()  # before the gateway is armed (a start is walked like any operation), then adopted
    w.count(w.main)
    w.kill()
    w.start(",".join(f"{p}:fail" for p in points))
    found: Dict[str, List[str]] = {}
    t0 = time.monotonic()
    for op in dict.fromkeys(p.split("/")[0] for p in points):
        for attempt in range(sum(p.startswith(op + "/") for p in points) + 1):
            w.running(w.main)
            SCENARIOS[op](w)
            assert w.g.proc.poll() is None, f"{op}: the gateway exited: {w.g.log_text()[-3000:]}"
            problems = w.violations(restore=False, leaks=False)
            if problems:
                found[f"{op} (try {attempt + 1})"] = [str(v) for v in problems]
    log = w.g.log_text()
    w.kill()  # the cleanup pass: what a failed call left (a workspace, a checkpoint) goes at the next start
    w.start()
    w.finish(found, [p for p in points if FAILED.format(p) not in log], f"{len(points)} fail points", t0)
