"""`sandgate bench --density N`: host memory for N idle sandboxes, measured together.

N idle gVisor sandboxes (each has run ``1+1``) beside N idle local ipykernels
(jupyter_client, the baseline), started side by side in the same run. Memory is
read for all N at once, once it has settled (two reads 5 s apart within 1%),
so pages the sandboxes share (the runsc binary, a template image restored into
each) are split between them by PSS rather than counted N times: total PSS / N
is what one more sandbox costs, broken down by kind of host process. The drop in the host's MemAvailable is kept in the JSON
only: any other work on the host moves it. Then every sandbox is paused to disk: what is left is
host processes (should be none) and the bytes of their images.

Goal: at most 100 MiB PSS per idle sandbox, so 200+ fit in 24 GiB.
"""

from __future__ import annotations

import datetime as dt
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

from .harness import (IDLE_WAIT, BenchError, cell_result, conclude, default_home, dir_bytes, mib, need_psutil, progress,
                      runsc_version, runtime_memory, tree_memory)
from .targets import DirectTarget, SandgateTarget

GOAL_PSS_MIB = 100


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise BenchError("no MemAvailable in /proc/meminfo")


def kind(cmdline: List[str]) -> str:
    """What a sandbox's host process is, for the breakdown: the shim, runsc's parts."""
    line = " ".join(cmdline)
    if "shim.py" in line:
        return "shim (python)"
    for part in ("gofer", "boot"):
        if f"runsc-{part}" in line or f" {part} " in f" {line} ":
            return f"runsc {part}" + (" (sentry)" if part == "boot" else "")
    return "runsc, other processes"


def memory_by_kind(keys: List[str]) -> Dict[str, Dict[str, int]]:
    """PSS and process count per kind of host process, over every sandbox's process tree."""
    psutil = need_psutil()
    out: Dict[str, Dict[str, int]] = {}
    seen = set()
    for p in psutil.process_iter(["cmdline"]):
        line = " ".join(p.info.get("cmdline") or [])
        if p.pid == os.getpid() or not any(k and k in line for k in keys):
            continue
        try:
            for q in [p] + p.children(recursive=True):
                if q.pid in seen:
                    continue
                seen.add(q.pid)
                row = out.setdefault(kind(q.cmdline()), {"pss": 0, "processes": 0})
                row["pss"] += q.memory_full_info().pss
                row["processes"] += 1
        except psutil.Error:
            continue
    return out


SETTLE_STEP = 5.0  # seconds between two reads while memory settles
SETTLE_MAX = 60.0


def settled(read) -> dict:
    """read() once it stops falling: an idle kernel's memory, not one caught
    mid-release (a restored Sentry hands its restore garbage back over ~15 s,
    drivers/gvisor.py). Settled when a read is within 1% of the one before."""
    last = read()
    deadline = time.monotonic() + SETTLE_MAX
    while time.monotonic() < deadline:
        time.sleep(SETTLE_STEP)  # the interval between reads; the condition is the change between them
        now = read()
        if now["pss"] is None or last["pss"] is None or abs(now["pss"] - last["pss"]) <= last["pss"] * 0.01:
            return now
        progress(f"memory still settling: PSS {mib(last['pss']):.1f} -> {mib(now['pss']):.1f} MiB")
        last = now
    return last


def start_sandboxes(t: SandgateTarget, n: int) -> List[str]:
    sids = []
    for i in range(n):  # one at a time, as the local kernels: the start column compares like with like
        sid = t.create_sandbox()
        if cell_result(t.run_cell(sid, "1+1")) != "2":
            raise BenchError(f"1+1 in sandbox {sid} gave no 2")
        sids.append(sid)
        progress(f"sandbox {i + 1}/{n} up")
    return sids


def start_local(d: DirectTarget, n: int) -> list:
    kernels = []
    for i in range(n):
        k = d.start_kernel()
        k.execute("1+1")
        kernels.append(k)
        progress(f"local kernel {i + 1}/{n} up")
    return kernels


def run(args) -> int:
    n = args.density
    if n < 1:
        print("sandgate bench: --density needs at least 1 sandbox", file=sys.stderr)
        return 2
    home = Path(args.home) if args.home else default_home()
    from sandgate_images import rootfs

    rootfs.build(home)
    logdir = Path(tempfile.mkdtemp(prefix="sandgate-bench-density-"))
    t = SandgateTarget(logdir, home, "sandgate-density", {"SANDGATE_MAX_KERNELS": str(n + 2),
                                                         "SANDGATE_POOL_SIZE": "1"})
    d = DirectTarget(logdir)
    report: Dict[str, object] = {}
    failed = None
    try:
        progress(f"starting a gateway on port {t.port} (log {t.log_path})")
        t.setup()
        # The baseline first, measured and stopped, so neither side's memory is in the other's MemAvailable.
        before = mem_available()
        t0 = time.monotonic()
        kernels = start_local(d, n)
        local_start = time.monotonic() - t0
        time.sleep(IDLE_WAIT)  # idle kernels settle (their allocations after a cell), not a condition to wait on
        local = settled(lambda: tree_memory([need_psutil().Process(k.km.provisioner.pid) for k in kernels]))
        local_drop = before - mem_available()
        d.teardown()

        before = mem_available()
        t0 = time.monotonic()
        sids = start_sandboxes(t, n)
        sandgate_start = time.monotonic() - t0
        time.sleep(IDLE_WAIT)
        keys = sids + [t.runtime_id(s) or "" for s in sids]
        sand = settled(lambda: runtime_memory([k for k in keys if k]))
        by_kind = memory_by_kind([k for k in keys if k])
        sand_drop = before - mem_available()

        progress(f"pausing the {n} sandboxes to disk")
        for s in sids:
            t.pause(s)
        paused = runtime_memory([k for k in keys if k])
        paused_disk = dir_bytes(t.home / "paused") or 0
        report = {
            "timestamp": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "host": {"cpu_count": os.cpu_count(), "python": platform.python_version(),
                     "platform": platform.platform(), "runsc": runsc_version(),
                     "runsc_reclaim": os.environ.get("SANDGATE_RUNSC_RECLAIM", "auto")},
            "n": n,
            "local": {**local, "mem_available_drop": local_drop, "start_all_s": local_start},
            "sandgate": {**sand, "mem_available_drop": sand_drop, "start_all_s": sandgate_start, "by_kind": by_kind},
            "paused": {"processes": paused["processes"], "rss": paused["rss"], "disk_bytes": paused_disk},
        }
    except KeyboardInterrupt:
        failed = "interrupted"
    except BenchError as e:
        failed = str(e)
    finally:
        d.teardown()
        t.teardown()
    return conclude(failed, logdir, args.output, report, table)


def table(r: dict) -> str:
    n, loc, sg = r["n"], r["local"], r["sandgate"]

    def each(side: dict, key: str) -> str:
        return "-" if side.get(key) is None else f"{mib(side[key] / n):.1f}"

    def ratio(key: str) -> str:
        a, b = sg.get(key), loc.get(key)
        return "-" if a is None or not b else f"{a / b:.1f}x"

    rows = [(f"PSS per idle kernel, {n} together (MiB)", each(loc, "pss"), each(sg, "pss"), ratio("pss")),
            (f"RSS per idle kernel, {n} together (MiB)", each(loc, "rss"), each(sg, "rss"), ratio("rss")),
            (f"start all {n} (s)", f"{loc['start_all_s']:.1f}", f"{sg['start_all_s']:.1f}", ratio("start_all_s"))]
    out = ["| metric | local ipykernel | sandgate (gVisor) | ratio |", "| --- | ---: | ---: | ---: |"]
    out += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    for k, v in sorted(sg.get("by_kind", {}).items(), key=lambda kv: -kv[1]["pss"]):
        out.append(f"| sandbox PSS per kernel: {k} ({v['processes'] / n:g} each) | | {mib(v['pss'] / n):.1f} | |")
    p = r["paused"]
    pss_each = (sg.get("pss") or 0) / n
    out.append("")
    out.append(f"goal: at most {GOAL_PSS_MIB} MiB PSS per idle sandbox: "
               f"{'met' if sg.get('pss') is not None and mib(pss_each) <= GOAL_PSS_MIB else 'not met'}"
               f" ({mib(pss_each):.1f} MiB; {int((24 << 30) / pss_each) if pss_each else 0} would fit in 24 GiB)")
    out.append(f"paused to disk: {p['processes']} host processes left ({mib(p['rss']):.1f} MiB RSS), "
               f"{mib(p['disk_bytes'] / n):.1f} MiB of disk each")
    return "\n".join(out)
