"""`sandgate bench --e2b N`: the E2B adapter's overhead.

One gateway; N rounds, each doing the same three steps twice, in alternating
order so a noisy host hits both alike:

* e2b: the unmodified ``e2b-code-interpreter`` SDK pointed at the gateway's
  /e2b: ``Sandbox.create()`` -> ``run_code("1+1")`` (must be "2") -> ``kill()``;
* native: Sandgate's own SDK (``sandgate_client``) on the sandbox API:
  ``Sandbox.create()`` -> ``run_code("1+1")`` -> ``kill()`` (``POST /api/sandboxes``,
  the streamed ``POST .../execute``, ``DELETE``).

Every create takes the same path: warm start with an empty pool
(``SANDGATE_POOL_SIZE=0``), i.e. a restore of the template checkpoint, so
neither side gets a pooled sandbox the other did not. One untimed round of
each first (imports, connections). Medians per step and of the whole, the
ratio of the medians, and the median of the per-round ratios e2b/native with
their spread (the two runs of a round are adjacent in time, so host drift
cancels; the goal: under 1.10). Then 100 ``1+1`` round trips each, in rotating
order, on a live sandbox: each SDK's ``run_code``, and ``POST /e2b/execute`` and
the native execute over plain http.client (both APIs without either SDK's
client): the per-call cost without a sandbox start (hundreds of ms, noisy on a
shared host) in the figure.
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

from .harness import BenchError, default_home, progress
from .targets import SandgateTarget

STEPS = ("create", "run_code", "kill", "total")
RUN_CODE_REPS = 100  # run_code("1+1") round trips per side on a live sandbox


class Raw:
    """Plain http.client on one keep-alive connection: an API's cost without any SDK's client
    (deliberately not the SDK, which is measured beside it)."""

    def __init__(self, port: int, token: str):
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=180)
        self.headers = {"Authorization": f"token {token}", "Content-Type": "application/json"}

    def post(self, path: str, body: dict, headers: dict) -> bytes:
        self.conn.request("POST", path, body=json.dumps(body), headers={**self.headers, **headers})
        r = self.conn.getresponse()
        raw = r.read()
        if r.status != 200:
            raise BenchError(f"POST {path} answered {r.status}: {raw[:300]!r}")
        return raw

    def close(self):
        self.conn.close()


def native_round(url: str, token: str) -> Dict[str, float]:
    from sandgate_client import Sandbox

    t0 = time.perf_counter()
    sb = Sandbox.create(url, token)
    t1 = time.perf_counter()
    ex = sb.run_code("1+1")
    t2 = time.perf_counter()
    sb.kill()
    t3 = time.perf_counter()
    if ex.text != "2":
        raise BenchError(f"native: run_code('1+1') gave {ex!r}")
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


def round_trips(opts: dict, url: str, token: str, raw: Raw, reps: int) -> Dict[str, List[float]]:
    """``run_code("1+1")`` on one live sandbox of each kind, ``reps`` times, rotating: each SDK, and
    each API over plain http.client: the per-call cost without a sandbox start in the figure."""
    from e2b_code_interpreter import Sandbox
    from sandgate_client import Sandbox as Native

    sb = Sandbox.create(**opts)
    nb = Native.create(url, token)
    out: Dict[str, List[float]] = {"e2b": [], "e2b-http": [], "native": [], "native-http": []}
    names = list(out)
    headers = {"E2b-Sandbox-Id": sb.sandbox_id, "E2b-Sandbox-Port": "49999"}
    if sb._envd_access_token:
        headers["X-Access-Token"] = sb._envd_access_token

    def e2b_http() -> bool:
        lines = [json.loads(x) for x in raw.post("/e2b/execute", {"code": "1+1"}, headers).splitlines()]
        return any(x.get("type") == "result" and x.get("text") == "2" for x in lines)

    def native_http() -> bool:
        d = json.loads(raw.post(f"/api/sandboxes/{nb.id}/execute", {"code": "1+1"}, {}))
        return any(o.get("type") == "execute_result" and o["data"].get("text/plain") == "2" for o in d["outputs"])

    run = {"e2b": lambda: sb.run_code("1+1").text == "2", "e2b-http": e2b_http,
           "native": lambda: nb.run_code("1+1").text == "2", "native-http": native_http}
    try:
        for i in range(reps + 5):  # 5 untimed first
            for name in names[i % 4:] + names[:i % 4]:
                t0 = time.perf_counter()
                ok = run[name]()
                dt_ = time.perf_counter() - t0
                if not ok:
                    raise BenchError(f"{name}: 1+1 did not give 2")
                if i >= 5:
                    out[name].append(dt_)
    finally:
        sb.kill()
        nb.kill()
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
    rows = [("step (median, ms)", "e2b SDK via /e2b", "Sandgate SDK, native API", "e2b/native")]
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
    home = Path(args.home) if args.home else default_home()
    from sandgate_images import rootfs

    rootfs.build(home)
    logdir = Path(tempfile.mkdtemp(prefix="sandgate-bench-e2b-"))
    t = SandgateTarget(logdir, home, "sandgate-e2b", {"SANDGATE_POOL_SIZE": "0", "SANDGATE_KEEP_SANDBOXES": "false"})
    raw: Dict[str, List[Dict[str, float]]] = {"e2b": [], "native": []}
    failed = None
    raw_http = None
    try:
        progress(f"starting a gateway on port {t.port} (log {t.log_path})")
        t.setup()
        url = f"http://127.0.0.1:{t.port}/e2b"
        opts = {"api_key": e2b_api_key(t.token), "api_url": url, "sandbox_url": url, "domain": "sandgate.invalid"}
        e2b_round(opts), native_round(t.url, t.token)  # untimed: imports, connections, first restore
        for i in range(rounds):
            order = [("e2b", lambda: e2b_round(opts)), ("native", lambda: native_round(t.url, t.token))]
            for name, fn in (order if i % 2 == 0 else order[::-1]):
                m = fn()
                raw[name].append(m)
                progress(f"round {i + 1}/{rounds} {name}: " + ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in m.items()))
        served = server_times(t.log_path.read_text(errors="replace"))
        progress(f"run_code round trips: {RUN_CODE_REPS} of each on one sandbox")
        raw_http = Raw(t.port, t.token)
        trips = round_trips(opts, t.url, t.token, raw_http, RUN_CODE_REPS)
    except KeyboardInterrupt:
        failed = "interrupted"
    except BenchError as e:
        failed = str(e)
    except Exception as e:  # the SDK's exceptions: a failed bench, with the gateway's log kept
        failed = f"{type(e).__name__}: {e}"
    finally:
        if raw_http:
            raw_http.close()
        t.teardown()
    if failed:
        print(f"sandgate bench: {failed}\n  gateway log: {logdir}", file=sys.stderr)
        return 130 if failed == "interrupted" else 1
    summary = {k: {s: statistics.median(r[s] for r in rs) for s in STEPS} for k, rs in raw.items()}
    ratio = summary["e2b"]["total"] / summary["native"]["total"]
    # Each round's two runs are adjacent in time: their ratio cancels the host's drift (a shared host's load
    # moves the medians of both sides by more than the adapter costs).
    per_round = [e["total"] / n["total"] for e, n in zip(raw["e2b"], raw["native"])]
    paired = statistics.median(per_round)
    # The spread of the per-round ratios: their quartiles (all of them with fewer than 4 rounds) and extremes.
    q1, q3 = (statistics.quantiles(per_round, n=4)[0], statistics.quantiles(per_round, n=4)[2]) \
        if len(per_round) >= 4 else (min(per_round), max(per_round))
    spread = {"q1": q1, "q3": q3, "min": min(per_round), "max": max(per_round)}
    fastest = {k: min(r["total"] for r in rs) for k, rs in raw.items()}
    report = {"timestamp": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "host": {"cpu_count": os.cpu_count(), "python": platform.python_version(),
                       "platform": platform.platform()},
              "config": {"rounds": rounds, "start": "template restore (SANDGATE_POOL_SIZE=0)",
                         "e2b": version("e2b"), "e2b_code_interpreter": version("e2b-code-interpreter")},
              "summary": summary, "ratio_total": ratio, "ratio_paired_median": paired,
              "ratio_paired_spread": spread, "ratio_per_round": per_round,
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
          f"{trip['e2b'] * 1000:.1f} / {trip_p90['e2b'] * 1000:.1f}; Sandgate's SDK's run_code "
          f"{trip['native'] * 1000:.1f} / {trip_p90['native'] * 1000:.1f}; over plain http.client: /e2b/execute "
          f"{trip['e2b-http'] * 1000:.1f} / {trip_p90['e2b-http'] * 1000:.1f}, native execute "
          f"{trip['native-http'] * 1000:.1f} / {trip_p90['native-http'] * 1000:.1f}; adapter/native (http.client) "
          f"{trip['e2b-http'] / trip['native-http']:.3f}, e2b SDK/Sandgate SDK {trip['e2b'] / trip['native']:.3f}")
    if all(k in served.get(side, {}) for side in ("e2b", "native") for k in ("create", "run_code", "kill")):
        print("gateway's own time per step, median (ms, its access log): " + "; ".join(
            f"{k} {served['e2b'][k] * 1000:.1f} (e2b) vs {served['native'][k] * 1000:.1f} (native)"
            for k in ("create", "run_code", "kill")))
    print(f"\nratio of the medians: {ratio:.3f}; median of the {rounds} per-round ratios: {paired:.3f} "
          f"(quartiles {q1:.3f}-{q3:.3f}, range {spread['min']:.3f}-{spread['max']:.3f}); "
          f"fastest round {fastest['e2b'] * 1000:.0f} ms vs {fastest['native'] * 1000:.0f} ms "
          f"({fastest['e2b'] / fastest['native']:.3f})")
    print(f"adapter overhead (per-round): {(paired - 1) * 100:+.1f}% (goal: under +10%: "
          f"{'met' if paired < 1.10 else 'NOT met'})")
    print(f"raw numbers: {args.output}")
    return 0
