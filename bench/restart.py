"""`sandgate bench --restart N`: a gateway restart with N sandboxes.

One gateway (warm start on, sandboxes kept at exit) starts N sandboxes and
runs ``x = 41`` in each. Measured:

* the ``1+1`` round trip over the Jupyter websocket before the restart (p50);
* SIGTERM to exit: every sandbox paused to disk (SANDGATE_SHUTDOWN_PARALLEL
  at a time);
* ``serve`` again on the same home until ``GET /api`` answers;
* from then, for each sandbox in turn, a request to its first result: the
  resume from disk plus ``x`` (which must still be 41);
* the ``1+1`` round trip after, on a resumed sandbox; its ratio to the round
  trip before is the regression check (about 1 is right).
"""

from __future__ import annotations

import datetime as dt
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Dict, List

from .harness import BenchError, conclude, default_home, percentile, progress
from .targets import SandgateTarget

ROUND_TRIPS = 100
CODE = "1+1"


def round_trips(t: SandgateTarget, sid: str, n: int) -> List[float]:
    k = t.connect(sid)
    try:
        for _ in range(5):
            k.execute(CODE)
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            k.execute(CODE)
            out.append(time.perf_counter() - t0)
        return out
    finally:
        k.close()


def run(args) -> int:
    n = max(1, args.restart)
    home = Path(args.home) if args.home else default_home()
    from sandgate_images import rootfs

    rootfs.build(home)
    logdir = Path(tempfile.mkdtemp(prefix="sandgate-bench-restart-"))
    env = {"SANDGATE_KEEP_SANDBOXES": "true", "SANDGATE_MAX_KERNELS": str(max(16, n + 2))}
    t = SandgateTarget(logdir, home, "sandgate-restart", env)
    report: Dict[str, object] = {}
    failed = None
    try:
        progress(f"starting a gateway on port {t.port} (log {t.log_path})")
        t.setup()
        ids = []
        for i in range(n):
            sid = t.create_sandbox()
            t.run_cell(sid, "x = 41")
            ids.append(sid)
            progress(f"sandbox {i + 1}/{n} ready")
        before = round_trips(t, ids[0], args.runs or ROUND_TRIPS)
        progress(f"1+1 before: p50 {percentile(before, 50) * 1e3:.2f} ms; SIGTERM")
        t0 = time.monotonic()
        t.proc.terminate()
        t.proc.wait(600)
        exit_s = time.monotonic() - t0
        t._log.close()
        progress(f"exited in {exit_s:.1f} s; serving again on the same home")
        t.kernels.clear()  # kept on purpose: the next gateway resumes them
        t.warm = False  # its template exists already: nothing to wait for
        t0 = time.monotonic()
        t.setup()  # returns once GET /api answers
        ready_s = time.monotonic() - t0
        first: List[float] = []
        for sid in ids:
            t1 = time.monotonic()
            out = t.run_cell(sid, "print(x)")
            first.append(time.monotonic() - t1)
            if out.stdout != "41\n":
                raise BenchError(f"sandbox {sid} came back without its state: {out}")
            t.kernels[sid] = None  # deleted on the way out
        all_s = time.monotonic() - t0
        after = round_trips(t, ids[0], args.runs or ROUND_TRIPS)
        report = {
            "timestamp": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "sandboxes": n, "cpu_count": os.cpu_count(),
            "sigterm_to_exit_s": exit_s, "start_to_ready_s": ready_s, "start_to_all_results_s": all_s,
            "first_result_s": {"median": statistics.median(first), "max": max(first), "all": first},
            "roundtrip_before_ms": {"p50": percentile(before, 50) * 1e3, "p90": percentile(before, 90) * 1e3},
            "roundtrip_after_ms": {"p50": percentile(after, 50) * 1e3, "p90": percentile(after, 90) * 1e3},
            "roundtrip_ratio_after_before": percentile(after, 50) / percentile(before, 50),
        }
    except KeyboardInterrupt:
        failed = "interrupted"
    except BenchError as e:
        failed = str(e)
    finally:
        progress("stopping the gateway")
        try:
            t.teardown()
        except Exception as e:
            progress(f"warning: cleanup: {e}")
    return conclude(failed, logdir, args.output, report, lambda r: (
        f"| restart with {n} sandboxes | |\n| --- | --- |\n"
        f"| SIGTERM to exit (all paused to disk) | {r['sigterm_to_exit_s']:.1f} s |\n"
        f"| serve to answering | {r['start_to_ready_s']:.1f} s |\n"
        f"| first result per sandbox (resume + cell), median / max | "
        f"{r['first_result_s']['median']:.2f} / {r['first_result_s']['max']:.2f} s |\n"
        f"| serve to every sandbox's first result | {r['start_to_all_results_s']:.1f} s |\n"
        f"| `1+1` p50 before / after | {r['roundtrip_before_ms']['p50']:.1f} / "
        f"{r['roundtrip_after_ms']['p50']:.1f} ms (ratio {r['roundtrip_ratio_after_before']:.2f}) |"))
