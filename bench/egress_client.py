"""The HTTP client of `sandgate bench --egress`: the same code runs on the host and inside a sandbox.

Standard library only (the sandbox has Debian's python3 and nothing else). On the host the bench runs
this file as a script: one JSON config per stdin line, one JSON result per stdout line. Inside a
sandbox it executes this source once in the kernel and then calls ``measure(config)`` per cell.

``measure`` runs ``conc`` threads, each with its own connection made by ``http.client``: direct to
``address`` (the name still used for the Host header, SNI and certificate check), or through an HTTP
proxy (``proxy``: a URL, or "env" for the sandbox's HTTP_PROXY/HTTPS_PROXY), plain HTTP as absolute-form
requests and HTTPS as CONNECT then TLS. ``mode`` "keep" reuses each thread's connection (after
``warmup`` untimed requests on it); "new" makes a connection per request and times it with the request.
Once every thread is warm (a barrier), each sends GETs back to back until ``duration`` seconds have
passed; a request started before then counts. Each latency is a request's start to its last body byte.
"""

import http.client
import json
import os
import socket
import ssl
import sys
import threading
import time

TIMEOUT = 60.0


def _connection(cfg, ctx):
    scheme, host, port = cfg["scheme"], cfg["host"], cfg["port"]
    proxy = cfg.get("proxy")
    if proxy == "env":
        proxy = os.environ["HTTPS_PROXY" if scheme == "https" else "HTTP_PROXY"]
    if proxy:
        phost, pport = proxy.split("://", 1)[-1].rstrip("/").rsplit(":", 1)
        if scheme == "https":
            c = http.client.HTTPSConnection(phost, int(pport), timeout=TIMEOUT, context=ctx)
            c.set_tunnel(host, port)
            return c, cfg["path"]
        return http.client.HTTPConnection(phost, int(pport), timeout=TIMEOUT), f"http://{host}:{port}{cfg['path']}"
    if scheme == "https":
        c = http.client.HTTPSConnection(host, port, timeout=TIMEOUT, context=ctx)
    else:
        c = http.client.HTTPConnection(host, port, timeout=TIMEOUT)
    address = cfg["address"]  # the name does not resolve on the host: connect to its address
    c._create_connection = lambda a, timeout=None, source=None: socket.create_connection((address, a[1]), timeout,
                                                                                           source)
    return c, cfg["path"]


def measure(cfg):
    ctx = None
    if cfg["scheme"] == "https":
        ctx = ssl.create_default_context(cafile=cfg.get("cafile"))  # none: the system's (SSL_CERT_FILE inside)
    conc, mode = int(cfg["conc"]), cfg.get("mode", "keep")
    warmup, duration = int(cfg.get("warmup", 3)), float(cfg["duration"])
    start = [0.0]
    deadline = [None]

    def go():  # run by the last thread to reach the barrier, before any is released: warmups are done
        start[0] = time.perf_counter()
        deadline[0] = start[0] + duration

    barrier = threading.Barrier(conc + 1, action=go)
    lat = [[] for _ in range(conc)]
    got = [0] * conc
    errors = []

    def one(conn, path):
        made = conn is None
        if made:
            conn, path = _connection(cfg, ctx)
        conn.request("GET", path)
        r = conn.getresponse()
        body = r.read()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {body[:200]!r}")
        if mode == "new":
            conn.close()
            conn = None
        return conn, path, len(body)

    def worker(i):
        conn, path = None, None
        try:
            if mode == "keep":
                conn, path = _connection(cfg, ctx)
                for _ in range(max(1, warmup)):
                    conn, path, _ = one(conn, path)
        except Exception as e:  # noqa: BLE001 - reported, not raised, so the barrier still opens
            errors.append(f"warmup: {type(e).__name__}: {e}")
        barrier.wait()
        if errors:
            return
        try:
            while time.perf_counter() < deadline[0]:
                t0 = time.perf_counter()
                conn, path, n = one(conn, path)
                lat[i].append(time.perf_counter() - t0)
                got[i] += n
        except Exception as e:  # noqa: BLE001
            errors.append(f"{type(e).__name__}: {e}")
        finally:
            if conn is not None:
                conn.close()

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(conc)]
    for t in threads:
        t.start()
    barrier.wait()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start[0]
    all_lat = [round(x * 1e3, 4) for xs in lat for x in xs]  # ms
    return {"n": len(all_lat), "elapsed_s": elapsed, "bytes": sum(got), "latency_ms": all_lat,
            "errors": errors[:5], "error_count": len(errors)}


def main():
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            out = measure(json.loads(line))
        except Exception as e:  # noqa: BLE001 - the bench reports it
            out = {"error": f"{type(e).__name__}: {e}"}
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
