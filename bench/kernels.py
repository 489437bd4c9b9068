"""`sandgate bench`: Sandgate beside a plain local kernel and the PyPI Kernel Gateway.

Five targets are measured in one run, interleaved so that drift on a noisy
host hits them all alike:

* ``jupyter-client``: a local ipykernel driven over ZMQ by a
  ``BlockingKernelClient``, no gateway at all (the baseline);
* ``kernel-gateway``: ``jupyter kernelgateway`` from PyPI, driven over REST and
  the websocket (legacy JSON frames) by the bench's own plain client (``WSKernel``);
* ``sandgate-gvisor``: ``sandgate serve`` with warm start (the default), driven
  through Sandgate's SDK as a user would: ``Sandbox.create`` and the kernel
  websocket's ``KernelConnection`` (legacy JSON frames too); each start waits
  ``POOL_WAIT`` s first, so it takes a kernel from the refilled pool;
* ``sandgate-template``: warm start with ``SANDGATE_POOL_SIZE=0``: every start
  restores the template checkpoint (the pool-empty case);
* ``sandgate-cold``: ``SANDGATE_WARM_START=false``: every start boots Python.

Each Sandgate gateway has a home of its own (one gateway per home), sharing the
built image by a symlink; warm targets are measured only once their gateway
logged "template checkpoint ... made".

Metrics: kernel start (request to the first ``1+1`` execute_result, median of
``START_REPS``), the ``1+1`` execute round trip (request until both its
execute_reply and its idle status arrived; p50 and p99 after ``WARMUP``
warmup runs, in batches of ``BATCH`` alternating between targets), and the
memory one idle kernel adds (RSS and PSS summed over its process tree, from
psutil). Every kernel and subprocess is stopped on the way out, Ctrl-C and
errors included.

The checkpoint section runs on ``sandgate-gvisor`` over the sandbox API (the SDK):
checkpoint time and size after ``x = 41``, fork to the fork's first ``1+1``
result, pause, the execute that resumes a paused sandbox, and what a paused
sandbox holds in memory (its runtime processes) and on disk.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

from .harness import (IDLE_WAIT, WARMUP, BenchError, cell_result, default_home, dir_bytes, mib, percentile,
                      preflight, progress, runsc_version, runtime_memory)
from .targets import SANDGATE, DirectTarget, GatewayTarget, KernelGatewayTarget, SandgateTarget, Target

START_REPS = 3
BATCH = 20
TARGETS = ("jupyter-client", "kernel-gateway", "sandgate-gvisor", "sandgate-template", "sandgate-cold")
SANDGATE_TEMPLATE = "sandgate-template"
SANDGATE_COLD = "sandgate-cold"
POOL_WAIT = 3.0  # seconds before a warm start, for the pool to refill
CHECKPOINT_REPS = 3
CODE = "1+1"


def measure_checkpoints(t: SandgateTarget) -> dict:
    """Checkpoint, fork, pause and resume on one warm sandbox over the sandbox API."""
    raw = {"checkpoint_s": [], "state_bytes": [], "files_bytes": [], "new_bytes": [], "stored_bytes": [], "fork_s": [],
           "fork_sees_x": [], "pause_s": [], "resume_execute_s": [], "paused_rss": [], "paused_processes": [],
           "paused_disk_bytes": []}
    t.before_start()
    sid = t.create_sandbox()
    time.sleep(POOL_WAIT)  # let the pool refill before timing anything
    t.run_cell(sid, "x = 41")
    cps = []
    for i in range(CHECKPOINT_REPS):
        t0 = time.perf_counter()
        cp = t.checkpoint(sid).raw
        raw["checkpoint_s"].append(time.perf_counter() - t0)
        for key in ("state_bytes", "files_bytes", "new_bytes", "stored_bytes"):
            raw[key].append(cp.get(key))
        cps.append(cp["id"])
        progress(f"checkpoint {i + 1}/{CHECKPOINT_REPS}: {raw['checkpoint_s'][-1]:.2f} s, "
                 f"state {mib(cp.get('state_bytes') or 0):.1f} MiB, stored {mib(cp.get('stored_bytes') or 0):.2f} MiB "
                 f"(new workspace data {cp.get('new_bytes')} B)")
    for i in range(CHECKPOINT_REPS):
        t0 = time.perf_counter()
        fork = t.fork(sid, cps[i])
        out = t.run_cell(fork, CODE)
        raw["fork_s"].append(time.perf_counter() - t0)
        if cell_result(out) != "2":
            raise BenchError(f"{t.name}: 1+1 in fork {fork} gave {out!r}")
        raw["fork_sees_x"].append(cell_result(t.run_cell(fork, "x + 1")) == "42")
        t.runtime_id(fork)
        t.stop_kernel(fork)
        progress(f"fork {i + 1}/{CHECKPOINT_REPS}: {raw['fork_s'][-1]:.2f} s to the first 1+1")
    for i in range(CHECKPOINT_REPS):
        rid = t.runtime_id(sid)
        t0 = time.perf_counter()
        m = t.pause(sid)
        raw["pause_s"].append(time.perf_counter() - t0)
        if m.state != "paused":
            raise BenchError(f"{t.name}: sandbox {sid} is {m.state!r} after pause")
        time.sleep(1.0)
        mem = runtime_memory([rid, sid])
        raw["paused_rss"].append(mem["rss"])
        raw["paused_processes"].append(mem["processes"])
        raw["paused_disk_bytes"].append(dir_bytes(t.home / "paused" / sid))
        t0 = time.perf_counter()
        out = t.run_cell(sid, CODE)
        raw["resume_execute_s"].append(time.perf_counter() - t0)
        if cell_result(out) != "2":
            raise BenchError(f"{t.name}: 1+1 after resume gave {out!r}")
        progress(f"pause {i + 1}/{CHECKPOINT_REPS}: {raw['pause_s'][-1]:.2f} s, paused RSS "
                 f"{mib(mem['rss']):.1f} MiB in {mem['processes']} processes, on disk "
                 f"{mib(raw['paused_disk_bytes'][-1] or 0):.1f} MiB; execute that resumes: "
                 f"{raw['resume_execute_s'][-1]:.2f} s")
    t.stop_kernel(sid)
    return raw


def summarize_checkpoints(raw: dict) -> dict:
    def med(key, scale=1.0):
        vals = [v for v in raw.get(key, []) if v is not None]
        return statistics.median(vals) * scale if vals else None

    def first(key, scale=1.0):
        vals = raw.get(key) or []
        return vals[0] * scale if vals and vals[0] is not None else None

    return {"checkpoint_median_s": med("checkpoint_s"), "state_mib": med("state_bytes", 2**-20),
            "files_bytes": med("files_bytes"), "new_bytes": med("new_bytes"),
            "stored_mib": med("stored_bytes", 2**-20), "first_stored_mib": first("stored_bytes", 2**-20),
            "fork_to_first_result_median_s": med("fork_s"), "pause_median_s": med("pause_s"),
            "resume_execute_median_s": med("resume_execute_s"), "paused_rss_mib": med("paused_rss", 2**-20),
            "paused_processes": med("paused_processes"), "paused_disk_mib": med("paused_disk_bytes", 2**-20),
            "fork_sees_x": all(raw.get("fork_sees_x") or [False])}


CHECKPOINT_ROWS = [
    ("checkpoint_median_s", "checkpoint after `x = 41`, median (s)", "{:.2f}"),
    ("state_mib", "checkpoint state_bytes, median (MiB)", "{:.1f}"),
    ("first_stored_mib", "first checkpoint stored_bytes, state and files (MiB)", "{:.2f}"),
    ("stored_mib", "checkpoint stored_bytes, median (MiB)", "{:.2f}"),
    ("new_bytes", "checkpoint new_bytes (workspace files only), median (B)", "{:.0f}"),
    ("fork_to_first_result_median_s", "fork to its first 1+1 result, median (s)", "{:.2f}"),
    ("pause_median_s", "pause, median (s)", "{:.2f}"),
    ("resume_execute_median_s", "1+1 on a paused sandbox (resume round trip), median (s)", "{:.2f}"),
    ("paused_rss_mib", "paused sandbox RSS, its runtime processes (MiB)", "{:.1f}"),
    ("paused_disk_mib", "paused sandbox on disk, paused/<id> (MiB)", "{:.1f}"),
]


def goals(summary: dict) -> dict:
    def start(name):
        return summary.get(name, {}).get("start_median_s")

    def ratio(a, b):
        return start(a) / start(b) if start(a) is not None and start(b) else None

    out = {
        "cold/warm (pool)": ratio(SANDGATE_COLD, SANDGATE),
        "cold/warm (template, pool empty)": ratio(SANDGATE_COLD, SANDGATE_TEMPLATE),
        "warm (pool)/kernel-gateway": ratio(SANDGATE, "kernel-gateway"),
        "warm (template, pool empty)/kernel-gateway": ratio(SANDGATE_TEMPLATE, "kernel-gateway"),
    }
    met = {k: (None if v is None else v >= 3 if k.startswith("cold/") else v < 1) for k, v in out.items()}
    return {"ratios": out, "met": met, "goal": "cold/warm >= 3 and warm/kernel-gateway < 1"}


def checkpoint_table(cs: dict, g: dict) -> str:
    rows = [[label, "-" if cs.get(key) is None else fmt.format(cs[key])] for key, label, fmt in CHECKPOINT_ROWS]
    for k, v in g["ratios"].items():
        goal = "goal >= 3x" if k.startswith("cold/") else "goal < 1x"
        met = g["met"][k]
        rows.append([f"start ratio {k} ({goal})",
                     "-" if v is None else f"{v:.2f}x ({'met' if met else 'not met'})"])
    head = ["metric (sandgate-gvisor, warm)", "value"]
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(2)]
    line = lambda r: f"| {r[0].ljust(widths[0])} | {r[1].rjust(widths[1])} |"
    return "\n".join([line(head), f"|{'-' * (widths[0] + 2)}|{'-' * (widths[1] + 1)}:|"] + [line(r) for r in rows])


# -- the run ---------------------------------------------------------------------

def measure_start(target: Target) -> dict:
    """Start a kernel, time it to its first 1+1 result, then read its idle memory."""
    target.before_start()
    t0 = time.perf_counter()
    got: List[float] = []
    kernel = target.start_kernel()
    try:
        out = kernel.execute(CODE, on_result=lambda: got.append(time.perf_counter()))
        if not got or out["result"].get("text/plain") != "2":
            raise BenchError(f"{target.name}: 1+1 gave {out['result']!r}")
        start = got[0] - t0
        time.sleep(IDLE_WAIT)
        mem = target.memory(kernel)
    finally:
        target.stop_kernel(kernel)
    return {"start_s": start, "memory": mem}


def kernel_versions(kernel) -> dict:
    out = kernel.execute("import sys, ipykernel; (sys.version.split()[0], ipykernel.__version__)")
    text = (out["result"] or {}).get("text/plain", "")
    try:
        py, ipk = eval(text, {})  # a tuple of two string literals
        return {"python": py, "ipykernel": ipk}
    except Exception:
        return {"raw": text}


def summarize(results: dict) -> dict:
    s = {}
    for name, r in results.items():
        rt = r["roundtrip_s"]
        mem = r["memory"]

        def med(key):
            vals = [m[key] for m in mem if m.get(key) is not None]
            return statistics.median(vals) if vals else None

        s[name] = {
            "start_median_s": statistics.median(r["start_s"]) if r["start_s"] else None,
            "roundtrip_p50_ms": percentile(rt, 50) * 1e3 if rt else None,
            "roundtrip_p99_ms": percentile(rt, 99) * 1e3 if rt else None,
            "roundtrip_mean_ms": statistics.mean(rt) * 1e3 if rt else None,
            "idle_rss_mib": mib(med("rss")),
            "idle_pss_mib": mib(med("pss")),
            "gateway_delta_mib": mib(med("gateway_delta")),
            "cgroup_mib": mib(med("cgroup")),
        }
    return s


ROWS = [  # key, label, format
    ("start_median_s", "start to first result, median (s)", "{:.2f}"),
    ("roundtrip_p50_ms", "1+1 round trip p50 (ms)", "{:.2f}"),
    ("roundtrip_p99_ms", "1+1 round trip p99 (ms)", "{:.2f}"),
    ("idle_rss_mib", "idle kernel RSS, process tree (MiB)", "{:.1f}"),
    ("idle_pss_mib", "idle kernel PSS, process tree (MiB)", "{:.1f}"),
    ("gateway_delta_mib", "gateway process growth per kernel (MiB)", "{:.1f}"),
]


def ratios(summary: dict) -> dict:
    out = {}
    sg = summary.get(SANDGATE, {})
    for base in ("jupyter-client", "kernel-gateway"):
        b = summary.get(base, {})
        out[f"sandgate/{base}"] = {key: (sg[key] / b[key] if sg.get(key) is not None and b.get(key) else None)
                                   for key, _, _ in ROWS}
    return out


def table(summary: dict, rat: dict) -> str:
    cols = list(TARGETS) + list(rat)
    head = ["metric"] + cols
    rows = []
    for key, label, fmt in ROWS:
        row = [label]
        for name in TARGETS:
            v = summary.get(name, {}).get(key)
            row.append("-" if v is None else fmt.format(v))
        for r in rat.values():
            v = r.get(key)
            row.append("-" if v is None else f"{v:.2f}x")
        rows.append(row)
    widths = [max(len(str(r[i])) for r in [head] + rows) for i in range(len(head))]
    line = lambda r: "| " + " | ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)
                                       for i, (c, w) in enumerate(zip(r, widths))) + " |"
    sep = "|" + "|".join("-" * (w + 1) + (":" if i else "-") for i, w in enumerate(widths)) + "|"
    return "\n".join([line(head), sep] + [line(r) for r in rows])


def trace_breakdown(t: "SandgateTarget") -> dict:
    """Median span per message type from a traced gateway's log (all its
    traced cells: starts, warmup and round trips)."""
    from sandgate import trace

    try:
        with open(t.log_path, errors="replace") as f:
            return trace.summarize(f)
    except OSError:
        return {}


def trace_table(breakdown: dict) -> str:
    from sandgate import trace

    rows = sorted(breakdown.items(), key=lambda kv: kv[1].get("gw_sent", 0))
    hops = [h for h in trace.ORDER if any(h in r for _, r in rows)]
    out = ["| message | " + " | ".join(hops) + " | n |", "|---|" + "---:|" * (len(hops) + 1)]
    for name, r in rows:
        out.append(f"| {name} | " + " | ".join(f"{r[h]:.2f}" if h in r else "-" for h in hops) + f" | {r['n']} |")
    return "\n".join(out)


def run(args) -> int:
    home = Path(args.home) if args.home else default_home()
    runs = max(1, args.runs)
    try:
        preflight(home)
    except BenchError as e:
        print(f"sandgate bench: {e}", file=sys.stderr)
        return 1

    def on_term(signum, frame):
        raise KeyboardInterrupt

    old_term = signal.signal(signal.SIGTERM, on_term)
    logdir = Path(tempfile.mkdtemp(prefix="sandgate-bench-"))
    # --trace: every Sandgate gateway logs its spans (gateway/trace.py); the
    # breakdown of sandgate-gvisor's round trips is reported beside the table.
    tr = {"SANDGATE_TRACE": "1"} if getattr(args, "trace", False) else {}
    targets: List[Target] = [
        DirectTarget(logdir), KernelGatewayTarget(logdir),
        SandgateTarget(logdir, home, SANDGATE, {"SANDGATE_WARM_START": "true", **tr}, pool_wait=POOL_WAIT),
        SandgateTarget(logdir, home, SANDGATE_TEMPLATE, {"SANDGATE_WARM_START": "true", "SANDGATE_POOL_SIZE": "0", **tr}),
        SandgateTarget(logdir, home, SANDGATE_COLD, {"SANDGATE_WARM_START": "false", **tr}),
    ]
    breakdown: dict = {}
    nt = len(targets)
    checkpoint_raw: dict = {}
    results = {t.name: {"start_s": [], "memory": [], "roundtrip_s": [], "kernel": {}} for t in targets}
    live: Dict[str, object] = {}
    failed = None
    try:
        for t in targets:
            if isinstance(t, GatewayTarget):
                progress(f"starting {t.name} on port {t.port} (log {t.log_path})")
            t.setup()

        for rep in range(START_REPS):
            order = targets[rep % nt:] + targets[:rep % nt]
            for t in order:
                m = measure_start(t)
                results[t.name]["start_s"].append(m["start_s"])
                results[t.name]["memory"].append(m["memory"])
                progress(f"start {rep + 1}/{START_REPS} {t.name}: {m['start_s']:.2f} s, "
                         f"idle RSS {mib(m['memory']['rss']):.0f} MiB")

        for t in targets:
            k = t.start_kernel()
            live[t.name] = k
            results[t.name]["kernel"] = kernel_versions(k)
            for _ in range(WARMUP):
                k.execute(CODE)
        progress(f"round trips: {runs} per target after {WARMUP} warmup runs, in batches of {BATCH}")
        done, rnd = 0, 0
        while done < runs:
            n = min(BATCH, runs - done)
            order = targets[rnd % nt:] + targets[:rnd % nt]
            for t in order:
                k, rt = live[t.name], results[t.name]["roundtrip_s"]
                for _ in range(n):
                    t0 = time.perf_counter()
                    k.execute(CODE)
                    rt.append(time.perf_counter() - t0)
            done += n
            rnd += 1
            progress(f"round trips {done}/{runs}: " + ", ".join(
                f"{t.name} p50 {percentile(results[t.name]['roundtrip_s'], 50) * 1e3:.2f} ms" for t in targets))

        if tr:
            breakdown = trace_breakdown(next(t for t in targets if t.name == SANDGATE))
        for t in targets:  # the checkpoint section uses the warm gateway alone
            k = live.pop(t.name, None)
            if k is not None:
                t.stop_kernel(k)
        progress(f"checkpoints, forks, pause and resume on {SANDGATE}")
        checkpoint_raw = measure_checkpoints(next(t for t in targets if t.name == SANDGATE))
    except KeyboardInterrupt:
        failed = "interrupted"
    except BenchError as e:
        failed = str(e)
    except Exception as e:  # a target misbehaved in a way not foreseen: still clean up
        failed = f"{type(e).__name__}: {e}"
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # let the cleanup finish
        progress("stopping kernels and gateways")
        for t in targets:
            k = live.pop(t.name, None)
            try:
                if k is not None:
                    t.stop_kernel(k)
                t.teardown()
            except Exception as e:
                progress(f"warning: cleanup of {t.name}: {e}")
        signal.signal(signal.SIGTERM, old_term)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if failed:
        print(f"sandgate bench: {failed}", file=sys.stderr)
        print(f"  gateway logs: {logdir}", file=sys.stderr)
        return 130 if failed == "interrupted" else 1

    summary = summarize(results)
    rat = ratios(summary)
    cs = summarize_checkpoints(checkpoint_raw)
    g = goals(summary)
    versions = {}
    for t in targets:
        versions.update(t.versions())
    report = {
        "timestamp": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "host": {"cpu_count": os.cpu_count(), "python": platform.python_version(),
                 "platform": platform.platform(), "runsc": runsc_version(),
                 "runsc_platform": os.environ.get("SANDGATE_RUNSC_PLATFORM", "ptrace"), **versions},
        "config": {"runs": runs, "warmup": WARMUP, "batch": BATCH, "start_reps": START_REPS,
                   "idle_wait_s": IDLE_WAIT, "code": CODE, "home": str(home), "pool_wait_s": POOL_WAIT,
                   "checkpoint_reps": CHECKPOINT_REPS,
                   "targets_env": {t.name: t.extra_env for t in targets if isinstance(t, SandgateTarget)}},
        "summary": summary,
        "ratios": rat,
        "checkpoints": cs,
        "goals": g,
        "raw": results,
        "raw_checkpoints": checkpoint_raw,
        "trace": breakdown,
    }
    Path(args.output).write_text(json.dumps(report, indent=1))
    shutil.rmtree(logdir, ignore_errors=True)
    print(table(summary, rat))
    print()
    print(checkpoint_table(cs, g))
    if breakdown:
        print(f"\n{SANDGATE}, where a 1+1 round trip goes (median ms since the websocket frame arrived):")
        print(trace_table(breakdown))
    print(f"\nraw numbers: {args.output}")
    return 0
