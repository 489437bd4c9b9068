"""The probes against a real `sandgate serve`: ``/healthz`` (readiness) and ``/livez`` (liveness)
answer without a token, say only that the node is up, and ``/healthz`` turns 503 while the
gateway drains or shuts down, when ``/livez`` still answers 200 (deploy/k8s uses both)."""

from __future__ import annotations

import http.client
import json
import signal
import subprocess
import sys

from conftest import Gateway
from test_store import RedisServer


def probe(conn: http.client.HTTPConnection, path: str) -> tuple[int, dict]:
    conn.request("GET", path)
    r = conn.getresponse()
    return r.status, json.loads(r.read())


def test_healthz_is_503_while_the_gateway_stops(home, tmp_path):
    """SIGTERM with sandboxes to pause: the server stops listening, and a connection that was
    already open (a load balancer's) is told 503 stopping until the process exits."""
    g = Gateway(home, tmp_path, env={"SANDGATE_NODE_ID": "node-s", "SANDGATE_WARM_START": "false",
                                     "SANDGATE_KEEP_SANDBOXES": "true", "SANDGATE_SHUTDOWN_PARALLEL": "1"})
    conn = http.client.HTTPConnection("127.0.0.1", g.port, timeout=60)
    try:
        for _ in range(2):  # pausing these to disk, one at a time, is the window
            assert g.request("POST", "/api/sandboxes", {}).status == 201
        assert probe(conn, "/healthz") == (200, {"status": "ok", "node": "node-s"})
        g.proc.send_signal(signal.SIGTERM)
        seen = []
        while True:  # the same keep-alive connection, until the gateway says it is stopping
            status, body = probe(conn, "/healthz")
            seen.append(status)
            if status == 503:
                break
            assert status == 200 and g.proc.poll() is None, seen
        assert body == {"status": "stopping", "node": "node-s"}
        assert probe(conn, "/livez") == (200, {"status": "stopping", "node": "node-s"})
        assert g.proc.wait(120) == 0
    finally:
        conn.close()
        g.stop()


def test_healthz_is_503_during_a_drain_while_livez_stays_200(home, tmp_path):
    """`sandgate drain` (deploy/k8s runs it as the preStop hook): readiness off at once so the
    node is taken out of the Service; liveness on, or the kubelet would restart it midway."""
    redis_dir, shared = tmp_path / "redis", tmp_path / "checkpoints"
    redis_dir.mkdir()
    server = RedisServer(redis_dir)
    env = {"SANDGATE_REDIS_URL": server.url, "SANDGATE_WARM_START": "false", "SANDGATE_CHECKPOINT_STORE": str(shared),
           "SANDGATE_NODE_ID": "node-d", "SANDGATE_FLEET_KEY": "test-fleet-key-0123456789abcdef0123456789abcdef"}
    g = Gateway(home, tmp_path, env=env)
    drain = None
    try:
        for _ in range(2):
            assert g.request("POST", "/api/sandboxes", {}).status == 201
        conn = http.client.HTTPConnection("127.0.0.1", g.port, timeout=60)
        assert probe(conn, "/healthz")[0] == 200
        drain = subprocess.Popen([sys.executable, "-m", "sandgate.cli", "drain", "--url", g.url, "--token", g.token],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        while True:
            status, body = probe(conn, "/healthz")
            if status == 503:
                break
            assert status == 200 and drain.poll() is None, (status, drain.poll())
        assert body == {"status": "stopping", "node": "node-d"}
        assert probe(conn, "/livez") == (200, {"status": "stopping", "node": "node-d"})
        conn.close()
        out, err = drain.communicate(timeout=300)
        assert drain.returncode == 0, err
        assert "drained: 2 moved, 0 failed" in out, out
        assert g.proc.wait(60) == 0
    finally:
        if drain and drain.poll() is None:
            drain.kill()
        g.stop()
        server.stop()
