"""`sandgate bench --e2b N`: the E2B adapter's overhead.

One gateway; N rounds, each doing the same three steps twice, in alternating
order so a noisy host hits both alike:

* e2b: the unmodified ``e2b-code-interpreter`` SDK pointed at the gateway's
  /e2b: ``Sandbox.create()`` -> ``run_code("1+1")`` (must be "2") -> ``kill()``;
* native: the sandbox API over one keep-alive HTTP connection:
  ``POST /api/sandboxes`` -> ``POST /api/sandboxes/{id}/execute`` -> ``DELETE``.

Every create takes the same path: warm start with an empty pool
(``SANDGATE_POOL_SIZE=0``), i.e. a restore of the template checkpoint, so
neither side gets a pooled sandbox the other did not. One untimed round of
each first (imports, connections). Medians per step and of the whole, the
ratio of the medians, and the median of the per-round ratios e2b/native (the
two runs of a round are adjacent in time, so host drift cancels; the goal:
under 1.10). Then 100 ``1+1`` round trips each, in rotating order, on a live
sandbox: the SDK's ``run_code``, the same ``POST /e2b/execute`` over plain
http.client (the adapter without the SDK's client), and the native execute:
the per-call cost without a sandbox start (hundreds of ms, noisy on a shared
host) in the figure.
"""

from __future__ import annotations

import datetime as dt
import http.client
import json
import os
import platform
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

from sandgate.api.e2b import e2b_api_key

from .kernels import BenchError, SandgateTarget, _default_home, cell_result, progress

STEPS = ("create", "run_code", "kill", "total")
RUN_CODE_REPS = 100  # run_code("1+1") round trips per side on a live sandbox


class Native:
    """The sandbox API over one keep-alive connection, as a thin client would use it."""

    def __init__(self, port: int, token: str):
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=180)
        self.headers = {"Authorization": f"token {token}", "Content-Type": "application/json"}

    def call(self, method: str, path: str, body=None, expect=200):
        self.conn.request(method, path, body=json.dumps(body) if body is not None else None, headers=self.headers)
        r = self.conn.getresponse()
        raw = r.read()
        if r.status != expect:
            raise BenchError(f"native: {method} {path} answered {r.status}: {raw[:300]!r}")
        return json.loads(raw) if raw else None

    def close(self):
        self.conn.close()


def native_round(n: Native) -> Dict[str, float]:
    t0 = time.perf_counter()
    sid = n.call("POST", "/api/sandboxes", {}, expect=201)["id"]
    t1 = time.perf_counter()
    out = n.call("POST", f"/api/sandboxes/{sid}/execute", {"code": "1+1"})
    t2 = time.perf_counter()
    n.call("DELETE", f"/api/sandboxes/{sid}", expect=204)
    t3 = time.perf_counter()
    if cell_result(out) != "2":
        raise BenchError(f"native: 1+1 gave {out!r}")
    return {"create": t1 - t0, "run_code": t2 - t1, "kill": t3 - t2, "total": t3 - t0}


def e2b_round(opts: dict) -> Dict[str, float]:
    from e2b_code_interpreter import Sandbox

    t0 = time.perf_counter()
    sb = Sandbox.create(**opts)
    t1 = time.perf_counter()
    ex = sb.run_code("1+1")
    t2 = time.perf_counter()
    sb.kill()
    t3 = time.perf_counter()
    if ex.text != "2":
        raise BenchError(f"e2b: run_code('1+1') gave {ex!r}")
    return {"create": t1 - t0, "run_code": t2 - t1, "kill": t3 - t2, "total": t3 - t0}


def round_trips(opts: dict, n: Native, reps: int) -> Dict[str, List[float]]:
    """``run_code("1+1")`` on one live sandbox of each kind, ``reps`` times, alternating: the adapter's
    per-call cost without a sandbox start in the figure."""
    from e2b_code_interpreter import Sandbox

    sb = Sandbox.create(**opts)
    sid = n.call("POST", "/api/sandboxes", {}, expect=201)["id"]
    out: Dict[str, List[float]] = {"e2b": [], "e2b-http": [], "native": []}
    names = list(out)
    headers = {"E2b-Sandbox-Id": sb.sandbox_id, "E2b-Sandbox-Port": "49999", "Content-Type": "application/json"}
    if sb._envd_access_token:
        headers["X-Access-Token"] = sb._envd_access_token

    def adapter_only() -> bool:
        # /e2b/execute over the same keep-alive connection as the native calls: the adapter without the SDK
        n.conn.request("POST", "/e2b/execute", body=json.dumps({"code": "1+1"}), headers=headers)
        lines = [json.loads(x) for x in n.conn.getresponse().read().splitlines()]
        return any(x.get("type") == "result" and x.get("text") == "2" for x in lines)

    try:
        for i in range(reps + 5):  # 5 untimed first
            for name in names[i % 3:] + names[:i % 3]:
                t0 = time.perf_counter()
                if name == "e2b":
                    ok = sb.run_code("1+1").text == "2"
                elif name == "e2b-http":
                    ok = adapter_only()
                else:
                    ok = cell_result(n.call("POST", f"/api/sandboxes/{sid}/execute", {"code": "1+1"})) == "2"
                dt_ = time.perf_counter() - t0
                if not ok:
                    raise BenchError(f"{name}: 1+1 did not give 2")
                if i >= 5:
                    out[name].append(dt_)
    finally:
        sb.kill()
        n.call("DELETE", f"/api/sandboxes/{sid}", expect=204)
    return out


ACCESS = re.compile(r"\] (\d{3}) (POST|DELETE) (\S+) \([^)]*\) ([\d.]+)ms")


def server_times(log: str) -> Dict[str, Dict[str, float]]:
    """The gateway's own time per step (tornado's access log), medians: the adapter's server-side cost
    without either client's."""
    got: Dict[str, Dict[str, List[float]]] = {"e2b": {}, "native": {}}
    for status, method, path, ms in ACCESS.findall(log):
        path = path.split("?", 1)[0]
        if path in ("/e2b/v2/sandboxes", "/e2b/sandboxes"):
            key = ("e2b", "create")
        elif path == "/e2b/execute":
            key = ("e2b", "run_code")
        elif method == "DELETE" and path.startswith("/e2b/sandboxes/"):
            key = ("e2b", "kill")
        elif path == "/api/sandboxes" and method == "POST":
            key = ("native", "create")
        elif path.startswith("/api/sandboxes/") and path.endswith("/execute"):
            key = ("native", "run_code")
        elif method == "DELETE" and path.startswith("/api/sandboxes/"):
            key = ("native", "kill")
        else:
            continue
        got[key[0]].setdefault(key[1], []).append(float(ms) / 1000)
    return {side: {step: statistics.median(v) for step, v in steps.items()} for side, steps in got.items()}


def table(summary: Dict[str, Dict[str, float]]) -> str:
    rows = [("step (median, ms)", "e2b SDK via /e2b", "native sandbox API", "e2b/native")]
    for s in STEPS:
        e, n = summary["e2b"][s], summary["native"][s]
        rows.append((s if s != "total" else "create -> run_code -> kill", f"{e * 1000:.1f}", f"{n * 1000:.1f}",
                     f"{e / n:.3f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    line = lambda r: "| " + " | ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) + " |"
    sep = "|" + "|".join("-" * (w + 2) if i == 0 else "-" * (w + 1) + ":" for i, w in enumerate(widths)) + "|"
    return "\n".join([line(rows[0]), sep] + [line(r) for r in rows[1:]])


def run(args) -> int:
    try:
        import e2b_code_interpreter  # noqa: F401
        from importlib.metadata import version
    except ImportError:
        print("sandgate bench --e2b needs the e2b and e2b-code-interpreter packages (pip install '.[test]')",
              file=sys.stderr)
        return 2
    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)  # the SDK's transport logs every request at INFO
    rounds = args.e2b
    if rounds < 1:
        print("sandgate bench --e2b: N must be at least 1", file=sys.stderr)
        return 2
    home = Path(args.home) if args.home else _default_home()
    from sandgate_images import rootfs

    rootfs.build(home)
    logdir = Path(tempfile.mkdtemp(prefix="sandgate-bench-e2b-"))
    t = SandgateTarget(logdir, home, "sandgate-e2b", {"SANDGATE_POOL_SIZE": "0", "SANDGATE_KEEP_SANDBOXES": "false"})
    raw: Dict[str, List[Dict[str, float]]] = {"e2b": [], "native": []}
    failed = None
    native = None
    try:
        progress(f"starting a gateway on port {t.port} (log {t.log_path})")
        t.setup()
        url = f"http://127.0.0.1:{t.port}/e2b"
        opts = {"api_key": e2b_api_key(t.token), "api_url": url, "sandbox_url": url, "domain": "sandgate.invalid"}
        native = Native(t.port, t.token)
        e2b_round(opts), native_round(native)  # untimed: imports, connections, first restore
        for i in range(rounds):
            order = [("e2b", lambda: e2b_round(opts)), ("native", lambda: native_round(native))]
            for name, fn in (order if i % 2 == 0 else order[::-1]):
                m = fn()
                raw[name].append(m)
                progress(f"round {i + 1}/{rounds} {name}: " + ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in m.items()))
        served = server_times(t.log_path.read_text(errors="replace"))
        progress(f"run_code round trips: {RUN_CODE_REPS} of each on one sandbox")
        trips = round_trips(opts, native, RUN_CODE_REPS)
    except KeyboardInterrupt:
        failed = "interrupted"
    except BenchError as e:
        failed = str(e)
    except Exception as e:  # the SDK's exceptions: a failed bench, with the gateway's log kept
        failed = f"{type(e).__name__}: {e}"
    finally:
        if native:
            native.close()
        t.teardown()
    if failed:
        print(f"sandgate bench: {failed}\n  gateway log: {logdir}", file=sys.stderr)
        return 130 if failed == "interrupted" else 1
    summary = {k: {s: statistics.median(r[s] for r in rs) for s in STEPS} for k, rs in raw.items()}
    ratio = summary["e2b"]["total"] / summary["native"]["total"]
    # Each round's two runs are adjacent in time: their ratio cancels the host's drift (a shared host's load
    # moves the medians of both sides by more than the adapter costs).
    paired = statistics.median(e["total"] / n["total"] for e, n in zip(raw["e2b"], raw["native"]))
    fastest = {k: min(r["total"] for r in rs) for k, rs in raw.items()}
    report = {"timestamp": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "host": {"cpu_count": os.cpu_count(), "python": platform.python_version(),
                       "platform": platform.platform()},
              "config": {"rounds": rounds, "start": "template restore (SANDGATE_POOL_SIZE=0)",
                         "e2b": version("e2b"), "e2b_code_interpreter": version("e2b-code-interpreter")},
              "summary": summary, "ratio_total": ratio, "ratio_paired_median": paired,
              "fastest_total": fastest, "goal": "ratio < 1.10", "raw": raw}
    Path(args.output).write_text(json.dumps(report, indent=1))
    shutil.rmtree(logdir, ignore_errors=True)
    trip = {k: statistics.median(v) for k, v in trips.items()}
    trip_p90 = {k: statistics.quantiles(v, n=10)[-1] for k, v in trips.items()}
    report["run_code_round_trip"] = {"median": trip, "p90": trip_p90, "raw": trips}
    report["server_side_median"] = served
    Path(args.output).write_text(json.dumps(report, indent=1))
    print(table(summary))
    print(f"\n1+1 on a live sandbox, {RUN_CODE_REPS} each, median / p90 (ms): the e2b SDK's run_code "
          f"{trip['e2b'] * 1000:.1f} / {trip_p90['e2b'] * 1000:.1f}; /e2b/execute over plain http.client "
          f"{trip['e2b-http'] * 1000:.1f} / {trip_p90['e2b-http'] * 1000:.1f}; native execute "
          f"{trip['native'] * 1000:.1f} / {trip_p90['native'] * 1000:.1f}; adapter/native "
          f"{trip['e2b-http'] / trip['native']:.3f}, SDK/native {trip['e2b'] / trip['native']:.3f}")
    if all(k in served.get(side, {}) for side in ("e2b", "native") for k in ("create", "run_code", "kill")):
        print("gateway's own time per step, median (ms, its access log): " + "; ".join(
            f"{k} {served['e2b'][k] * 1000:.1f} (e2b) vs {served['native'][k] * 1000:.1f} (native)"
            for k in ("create", "run_code", "kill")))
    print(f"\nratio of the medians: {ratio:.3f}; median of the {rounds} per-round ratios: {paired:.3f}; "
          f"fastest round {fastest['e2b'] * 1000:.0f} ms vs {fastest['native'] * 1000:.0f} ms "
          f"({fastest['e2b'] / fastest['native']:.3f})")
    print(f"adapter overhead (per-round): {(paired - 1) * 100:+.1f}% (goal: under +10%: "
          f"{'met' if paired < 1.10 else 'NOT met'})")
    print(f"raw numbers: {args.output}")
    return 0
