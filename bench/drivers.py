"""`sandgate bench --drivers gvisor,qemu`: the sandbox drivers side by side.

One gateway (cold start, so a boot is a boot) runs every driver in the same
run, interleaved round by round so that a noisy host hits them alike. Per
driver and round, over the sandbox API:

* boot: create to the first ``1+1`` result;
* memory: RSS and PSS of the sandbox's host processes (runsc or qemu), idle;
* checkpoint after ``x = 41``: time and state size;
* a second checkpoint after ``x = 42``: its time, and what it stored
  (``stored_bytes``) over its running state's size (``state_bytes``): the
  running state is kept as shared chunks (gateway/state_chunks.py);
* restore: fork from a checkpoint to the fork's first ``1+1`` result (the
  fork must see its ``x``), from chunks, and from a whole image as every
  checkpoint was stored before chunking: one of the two checkpoints is turned
  back into one (``whole_image``), alternately the first and the second, and
  the order of the two forks alternates too;
* pause, and the ``1+1`` that resumes a paused sandbox;
* the same with a pause in memory (``{"mode": "memory"}``: frozen, not saved).

Medians over ``REPS`` rounds; the ratio column divides by the first driver.
Under TCG (no usable KVM) qemu numbers are an emulation floor, not KVM's.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

from .kernels import IDLE_WAIT, BenchError, SandgateTarget, _default_home, cell_result, mib, progress, runtime_memory

REPS = 3
METRICS = [  # key, label, format
    ("boot_s", "boot to first 1+1 (s)", "{:.2f}"),
    ("rss", "idle sandbox RSS, host processes (MiB)", "{:.1f}"),
    ("pss", "idle sandbox PSS, host processes (MiB)", "{:.1f}"),
    ("checkpoint_s", "checkpoint after x = 41 (s)", "{:.2f}"),
    ("state_bytes", "checkpoint state size (MiB)", "{:.1f}"),
    ("checkpoint2_s", "second checkpoint, after x = 42 (s)", "{:.2f}"),
    ("stored_ratio", "second checkpoint stored_bytes / state_bytes", "{:.3f}"),
    ("restore_s", "restore (fork) to first 1+1, from chunks (s)", "{:.2f}"),
    ("restore_whole_s", "restore (fork) to first 1+1, from a whole image (s)", "{:.2f}"),
    ("restore_ratio", "restore from chunks / from a whole image", "{:.2f}"),
    ("pause_s", "pause (s)", "{:.2f}"),
    ("resume_s", "1+1 on a paused sandbox (s)", "{:.2f}"),
    ("freeze_s", "pause in memory (s)", "{:.3f}"),
    ("thaw_s", "1+1 on a sandbox paused in memory (s)", "{:.3f}"),
]
IN_MIB = {"rss", "pss", "state_bytes"}


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def whole_image(t: SandgateTarget, cid: str) -> None:
    """Store checkpoint ``cid``'s running state the way it was stored before chunking: the image
    itself in its state directory (its chunks stay; another checkpoint may share them)."""
    from sandgate.state_chunks import MANIFEST, ChunkStore

    state = t.home / "checkpoints" / "items" / cid / "state"
    if not (state / MANIFEST).is_file():
        raise BenchError(f"checkpoint {cid} has no chunked state to turn into a whole image")
    ChunkStore(t.home / "checkpoints" / "chunks").assemble(state, state)
    (state / MANIFEST).unlink()


def one_round(t: SandgateTarget, driver: str, rep: int = 0) -> Dict[str, float]:
    m: Dict[str, float] = {}

    def first_result(sid: str) -> None:
        out = t.run_cell(sid, "1+1")
        if cell_result(out) != "2":
            raise BenchError(f"{driver}: 1+1 in {sid} gave {out!r}")

    def create() -> str:
        sid = t.api("POST", "/api/sandboxes", {"driver": driver}, expect=(201,))["id"]
        t.kernels[sid] = None  # deleted on the way out, whatever happens
        t.started_ids.append(sid)
        first_result(sid)
        return sid

    sid, m["boot_s"] = timed(create)
    rid = t.runtime_id(sid)
    time.sleep(IDLE_WAIT)
    mem = runtime_memory([sid, rid])
    m["rss"], m["pss"] = mem["rss"], mem["pss"]
    t.run_cell(sid, "x = 41")
    cp, m["checkpoint_s"] = timed(lambda: t.api("POST", f"/api/sandboxes/{sid}/checkpoints", {}, expect=(201,)))
    m["state_bytes"] = cp["state_bytes"]
    t.run_cell(sid, "x = 42")
    cp2, m["checkpoint2_s"] = timed(lambda: t.api("POST", f"/api/sandboxes/{sid}/checkpoints", {}, expect=(201,)))
    m["stored_ratio"] = cp2["stored_bytes"] / cp2["state_bytes"]

    def fork(c) -> str:
        fid = t.api("POST", f"/api/sandboxes/{sid}/fork", {"checkpoint": c["id"]}, expect=(201,))["id"]
        t.kernels[fid] = None
        t.started_ids.append(fid)
        first_result(fid)
        return fid

    whole, chunked = (cp, cp2) if rep % 2 == 0 else (cp2, cp)
    whole_image(t, whole["id"])
    for key, c in (("restore_s", chunked), ("restore_whole_s", whole))[::1 if rep % 2 == 0 else -1]:
        fid, m[key] = timed(lambda: fork(c))
        want = "41" if c is cp else "42"
        if cell_result(t.run_cell(fid, "x")) != want:
            raise BenchError(f"{driver}: the fork of {sid} from {c['id']} does not see x = {want}")
        t.stop_kernel(fid)
    m["restore_ratio"] = m["restore_s"] / m["restore_whole_s"]
    _, m["pause_s"] = timed(lambda: t.api("POST", f"/api/sandboxes/{sid}/pause", {}))
    _, m["resume_s"] = timed(lambda: first_result(sid))
    _, m["freeze_s"] = timed(lambda: t.api("POST", f"/api/sandboxes/{sid}/pause", {"mode": "memory"}))
    _, m["thaw_s"] = timed(lambda: first_result(sid))
    t.stop_kernel(sid)
    progress(f"{driver}: " + ", ".join(f"{k} {mib(v) if k in IN_MIB else v:.2f}" for k, v in m.items()
                                       if v is not None))
    return m


def table(drivers: List[str], summary: Dict[str, Dict[str, float]]) -> str:
    base = drivers[0]
    head = ["metric"] + drivers + [f"{d}/{base}" for d in drivers[1:]]
    rows = []
    for key, label, fmt in METRICS:
        row = [label]
        for d in drivers:
            v = summary[d].get(key)
            row.append("-" if v is None else fmt.format(mib(v) if key in IN_MIB else v))
        for d in drivers[1:]:
            a, b = summary[d].get(key), summary[base].get(key)
            row.append("-" if a is None or not b else f"{a / b:.1f}x")
        rows.append(row)
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
    line = lambda r: "| " + " | ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) + " |"
    sep = "|" + "|".join("-" * (w + 2) if i == 0 else "-" * (w + 1) + ":" for i, w in enumerate(widths)) + "|"
    return "\n".join([line(head), sep] + [line(r) for r in rows])


def run(args) -> int:
    from sandgate.drivers import DRIVERS

    drivers = [d.strip() for d in args.drivers.split(",") if d.strip()]
    unknown = [d for d in drivers if d not in DRIVERS]
    if not drivers or unknown:
        print(f"sandgate bench: unknown driver(s) {', '.join(unknown) or '(none given)'}; "
              f"known: {', '.join(DRIVERS)}", file=sys.stderr)
        return 2
    for d in drivers:
        ok, why = DRIVERS[d].probe()
        if not ok:
            print(f"sandgate bench: driver {d} cannot run here: {why}", file=sys.stderr)
            return 1
    home = Path(args.home) if args.home else _default_home()
    from sandgate_images import rootfs, vm

    rootfs.build(home)
    if any(d != "gvisor" for d in drivers):
        vm.build(home)
    logdir = Path(tempfile.mkdtemp(prefix="sandgate-bench-drivers-"))
    t = SandgateTarget(logdir, home, "sandgate-drivers", {"SANDGATE_WARM_START": "false"})
    raw: Dict[str, List[Dict[str, float]]] = {d: [] for d in drivers}
    failed = None
    try:
        progress(f"starting a gateway on port {t.port} (log {t.log_path})")
        t.setup()
        for rep in range(REPS):
            for d in drivers[rep % len(drivers):] + drivers[:rep % len(drivers)]:
                progress(f"round {rep + 1}/{REPS}: {d}")
                raw[d].append(one_round(t, d, rep))
    except KeyboardInterrupt:
        failed = "interrupted"
    except BenchError as e:
        failed = str(e)
    finally:
        log = t.log_path.read_text(errors="replace") if t.log_path.exists() else ""
        t.teardown()
    if failed:
        print(f"sandgate bench: {failed}\n  gateway log: {logdir}", file=sys.stderr)
        return 130 if failed == "interrupted" else 1
    # A metric no round produced stays None, shown as "-" rather than as a measured 0.
    summary = {d: {k: (statistics.median(vals) if vals else None)
                   for k, _, _ in METRICS for vals in [[r[k] for r in rs if r.get(k) is not None]]}
               for d, rs in raw.items()}
    accel = next((ln.split("qemu acceleration: ", 1)[1] for ln in log.splitlines() if "qemu acceleration: " in ln), None)
    report = {"timestamp": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "host": {"cpu_count": os.cpu_count(), "python": platform.python_version(),
                       "platform": platform.platform(), "qemu_accel": accel},
              "config": {"reps": REPS, "idle_wait_s": IDLE_WAIT, "drivers": drivers},
              "summary": summary, "raw": raw}
    Path(args.output).write_text(json.dumps(report, indent=1))
    shutil.rmtree(logdir, ignore_errors=True)
    print(table(drivers, summary))
    if accel:
        print(f"\nqemu acceleration: {accel}")
    print(f"raw numbers: {args.output}")
    return 0
