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
* the same with a pause in memory (``{"mode": "memory"}``: frozen, not saved);
* fork from now (a checkpoint and its restore) to the fork's first ``1+1``;
* the ``1+1`` round trip over the sandbox API (median of ``RTT_RUNS``).

``--runsc A,B`` compares runsc binaries instead (gvisor only): one gateway per
binary (``SANDGATE_RUNSC``), ``trixie`` naming the one `sandgate image runsc`
fetches; a runsc that checkpoints in place shows it in the checkpoint and fork rows.

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

from .harness import IDLE_WAIT, BenchError, cell_result, default_home, mib, progress, runtime_memory
from .targets import SandgateTarget

REPS = 3
RTT_RUNS = 20
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
    ("fork_now_s", "fork from now to first 1+1 (s)", "{:.2f}"),
    ("rtt_ms", "1+1 round trip, sandbox API, p50 (ms)", "{:.1f}"),
]
IN_MIB = {"rss", "pss", "state_bytes"}


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def whole_image(t: SandgateTarget, cid: str) -> None:
    """Store checkpoint ``cid``'s running state as one whole image, the baseline a restore from
    chunks is compared with: the image itself in its state directory (its chunks stay; another checkpoint may share them)."""
    from sandgate.checkpoints.state_chunks import MANIFEST, ChunkStore

    state = t.home / "checkpoints" / "items" / cid / "state"
    if not (state / MANIFEST).is_file():
        raise BenchError(f"checkpoint {cid} has no chunked state to turn into a whole image")
    # level 1: frames deflated as runsc writes them, not the stored blocks a restore from chunks gets
    ChunkStore(t.home / "checkpoints" / "chunks").assemble(state, state, level=1)
    (state / MANIFEST).unlink()


def one_round(t: SandgateTarget, driver: str, label: str, rep: int = 0) -> Dict[str, float]:
    m: Dict[str, float] = {}

    def first_result(sid: str) -> None:
        out = t.run_cell(sid, "1+1")
        if cell_result(out) != "2":
            raise BenchError(f"{driver}: 1+1 in {sid} gave {out!r}")

    def create() -> str:
        sid = t.create_sandbox(driver=driver)
        first_result(sid)
        return sid

    sid, m["boot_s"] = timed(create)
    rid = t.runtime_id(sid)
    time.sleep(IDLE_WAIT)
    mem = runtime_memory([sid, rid])
    m["rss"], m["pss"] = mem["rss"], mem["pss"]
    t.run_cell(sid, "x = 41")
    cp, m["checkpoint_s"] = timed(lambda: t.checkpoint(sid))
    m["state_bytes"] = cp.raw["state_bytes"]
    t.run_cell(sid, "x = 42")
    cp2, m["checkpoint2_s"] = timed(lambda: t.checkpoint(sid))
    m["stored_ratio"] = cp2.raw["stored_bytes"] / cp2.raw["state_bytes"]

    def fork(c) -> str:
        fid = t.fork(sid, c.id)
        first_result(fid)
        return fid

    whole, chunked = (cp, cp2) if rep % 2 == 0 else (cp2, cp)
    whole_image(t, whole.id)
    for key, c in (("restore_s", chunked), ("restore_whole_s", whole))[::1 if rep % 2 == 0 else -1]:
        fid, m[key] = timed(lambda: fork(c))
        want = "41" if c is cp else "42"
        if cell_result(t.run_cell(fid, "x")) != want:
            raise BenchError(f"{driver}: the fork of {sid} from {c.id} does not see x = {want}")
        t.stop_kernel(fid)
    m["restore_ratio"] = m["restore_s"] / m["restore_whole_s"]

    def fork_now() -> str:
        fid = t.fork(sid)
        first_result(fid)
        return fid

    fid, m["fork_now_s"] = timed(fork_now)
    t.stop_kernel(fid)
    rtts = [timed(lambda: first_result(sid))[1] for _ in range(RTT_RUNS)]
    m["rtt_ms"] = statistics.median(rtts) * 1000
    _, m["pause_s"] = timed(lambda: t.pause(sid))
    _, m["resume_s"] = timed(lambda: first_result(sid))
    _, m["freeze_s"] = timed(lambda: t.pause(sid, "memory"))
    _, m["thaw_s"] = timed(lambda: first_result(sid))
    t.stop_kernel(sid)
    progress(f"{label}: " + ", ".join(f"{k} {mib(v) if k in IN_MIB else v:.2f}" for k, v in m.items()
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


def runsc_columns(spec: str, home: Path) -> Dict[str, str]:
    """``--runsc a,b``: label -> binary, each label naming the runsc's version."""
    from sandgate.drivers.gvisor import _run_quietly
    from sandgate_images import runsc

    columns = {}
    for item in (x.strip() for x in spec.split(",") if x.strip()):
        path = str(runsc.fetch(home, progress=progress)) if item == "trixie" else (shutil.which(item) or item)
        version = _run_quietly([path, "--version"]).split("\n")[0].replace("runsc version ", "")
        if not version:
            raise BenchError(f"{item}: not a runsc that runs here")
        columns[f"runsc {version}"] = path
    if len(columns) < 1:
        raise BenchError("--runsc names no runsc")
    return columns


def run(args) -> int:
    from sandgate.config import Settings
    from sandgate.drivers import DRIVERS

    drivers = [d.strip() for d in args.drivers.split(",") if d.strip()]
    unknown = [d for d in drivers if d not in DRIVERS]
    if not drivers or unknown:
        print(f"sandgate bench: unknown driver(s) {', '.join(unknown) or '(none given)'}; "
              f"known: {', '.join(DRIVERS)}", file=sys.stderr)
        return 2
    if args.runsc and drivers != ["gvisor"]:
        print("sandgate bench: --runsc compares gvisor only (--drivers gvisor)", file=sys.stderr)
        return 2
    for d in drivers:
        ok, why = DRIVERS[d].probe(Settings.load())
        if not ok:
            print(f"sandgate bench: driver {d} cannot run here: {why}", file=sys.stderr)
            return 1
    home = Path(args.home) if args.home else default_home()
    from sandgate_images import rootfs, vm

    rootfs.build(home)
    if any(d != "gvisor" for d in drivers):
        vm.build(home)
    logdir = Path(tempfile.mkdtemp(prefix="sandgate-bench-drivers-"))
    # No kept images: the restore rows time the assembly from chunks against a whole image (a
    # kept image, made ahead after each checkpoint, would stand in for both); the default bench's
    # fork row times the kept one.
    env = {"SANDGATE_WARM_START": "false", "SANDGATE_KEPT_IMAGES_MB": "0"}
    try:
        # A column is (gateway, driver): one gateway for every driver, or one per runsc.
        if args.runsc:
            columns = {label: (SandgateTarget(logdir, home, f"sandgate-{i}", {**env, "SANDGATE_RUNSC": path}), "gvisor")
                       for i, (label, path) in enumerate(runsc_columns(args.runsc, home).items())}
        else:
            t = SandgateTarget(logdir, home, "sandgate-drivers", env)
            columns = {d: (t, d) for d in drivers}
    except BenchError as e:
        print(f"sandgate bench: {e}", file=sys.stderr)
        return 1
    names = list(columns)
    targets = list({id(t): t for t, _ in columns.values()}.values())
    raw: Dict[str, List[Dict[str, float]]] = {c: [] for c in names}
    failed, log = None, ""
    try:
        for t in targets:
            progress(f"starting a gateway on port {t.port} (log {t.log_path})")
            t.setup()
        for rep in range(REPS):
            for c in names[rep % len(names):] + names[:rep % len(names)]:
                progress(f"round {rep + 1}/{REPS}: {c}")
                raw[c].append(one_round(*columns[c], c, rep))
    except KeyboardInterrupt:
        failed = "interrupted"
    except BenchError as e:
        failed = str(e)
    finally:
        for t in targets:
            log += t.log_path.read_text(errors="replace") if t.log_path.exists() else ""
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
              "config": {"reps": REPS, "idle_wait_s": IDLE_WAIT, "columns": names},
              "summary": summary, "raw": raw}
    Path(args.output).write_text(json.dumps(report, indent=1))
    shutil.rmtree(logdir, ignore_errors=True)
    print(table(names, summary))
    if accel:
        print(f"\nqemu acceleration: {accel}")
    print(f"raw numbers: {args.output}")
    return 0
