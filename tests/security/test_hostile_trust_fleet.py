"""The fleet must not trust Redis completely: a Redis writer who rewrites a node's URL must not get
the next forwarded caller's token, what passes between the nodes is authenticated, and Redis AUTH
and TLS work. Real redis-servers (unix socket; TCP with a
password and an ACL user; TLS) and real `sandgate serve` nodes with gVisor sandboxes."""

from __future__ import annotations

import datetime
import http.server
import ipaddress
import json
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request

import pytest

from conftest import Gateway, free_port, wait_for
from sandgate_client import SandgateError
from test_fleet import FLEET_KEY, fleet_env, redis  # noqa: F401 (the fixture)
from test_store import RedisServer

SECRET = "sk-live-fleet-4c8e2a6f0b1d3e5f7a9b"


class Recorder(http.server.ThreadingHTTPServer):
    """A loopback HTTP listener that records every request. With ``target`` it relays each one
    there (so a node can be reached through it and what the other node sends it be seen);
    without, it answers ``[]`` itself: a listener an attacker put where a node should be."""

    daemon_threads = True

    def __init__(self):
        self.seen, self.target = [], None
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _any(self):
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else b""
                outer.seen.append({"method": self.command, "uri": self.path, "headers": dict(self.headers),
                                   "body": body})
                if self.headers.get("Upgrade", "").lower() == "websocket":  # seen, not relayed
                    status, headers, out = 502, {"Content-Type": "application/json"}, b"{}"
                elif outer.target is None:
                    status, headers, out = 200, {"Content-Type": "application/json"}, b"[]"
                else:
                    status, headers, out = relay(outer.target, self.command, self.path, dict(self.headers), body)
                self.send_response(status)
                for k, v in headers.items():
                    if k.lower() in ("content-type", "location"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _any

            def log_message(self, *args):
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def stop(self):
        self.shutdown()
        self.server_close()


def relay(base: str, method: str, uri: str, headers: dict, body: bytes):
    h = {k: v for k, v in headers.items() if k.lower() not in ("host", "content-length", "connection")}
    req = urllib.request.Request(base + uri, data=body if method in ("POST", "PUT", "PATCH") else None,
                                 method=method, headers=h)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def send(base: str, seen: dict, headers: dict = None, body: bytes = None) -> int:
    """``seen`` (a recorded request) sent again to ``base``, with ``headers`` changed."""
    h = {**seen["headers"], **(headers or {})}
    return relay(base, seen["method"], seen["uri"], h, seen["body"] if body is None else body)[0]


def node_env(url: str, **extra) -> dict:
    return {"SANDGATE_REDIS_URL": url, "SANDGATE_WARM_START": "false", "SANDGATE_FLEET_KEY": FLEET_KEY, **extra}


def refused(home, tmp, env) -> str:
    """The error of a gateway that must not start; one that starts anyway is stopped, and fails the test."""
    try:
        g = Gateway(home, tmp, env=env)
    except RuntimeError as e:
        return str(e)
    g.stop()
    pytest.fail("the gateway started")


def redis_cli(server, *args) -> str:
    return subprocess.run(["redis-cli", "-s", str(server.sock), *args], capture_output=True, text=True,
                          check=True).stdout.strip()


def test_a_fleet_node_needs_the_fleet_key(home, tmp_path, redis):
    e = refused(home, tmp_path, {"SANDGATE_REDIS_URL": redis.url, "SANDGATE_NODE_ID": "node-a"})
    assert "needs the fleet's key: set SANDGATE_FLEET_KEY" in e, e
    e = refused(home, tmp_path, fleet_env(redis, SANDGATE_FLEET_KEY="short", SANDGATE_NODE_ID="node-a"))
    assert "the fleet key has 5 characters, at least 32" in e, e


def test_forwarding_sends_no_token_and_only_to_nodes_signed_with_the_fleet_key(home, tmp_path, redis):
    """Node B is reached through a recording relay (its SANDGATE_NODE_URL): what A sends B carries no
    caller token (header or query), only A's signature for node-b, which B takes once: replayed,
    sent to another node, altered, or without it, the request is refused. Then a Redis writer points
    node-b's heartbeat at a listener of its own: A sends it nothing (no token, no request, no new
    sandbox) until B's own signed heartbeat is back. Secret values are nowhere in Redis in clear."""
    relay_b, listener = Recorder(), Recorder()
    a = b = None
    try:
        a = Gateway(home, tmp_path, env=fleet_env(redis, SANDGATE_NODE_ID="node-a"))
        b = Gateway(home, tmp_path, env=fleet_env(redis, SANDGATE_NODE_ID="node-b", SANDGATE_NODE_URL=relay_b.url))
        relay_b.target = b.url
        here = {"X-Sandgate-Forwarded": "test"}  # made on B itself
        tenant = a.request("POST", "/api/tenants", {"name": "acme8"}).json()["token"]
        sid = b.request("POST", "/api/sandboxes", SECRET_BODY, headers=here).json()["id"]
        tsid = b.request("POST", "/api/sandboxes", {}, token=tenant, headers=here).json()["id"]

        # Through A: the admin (header, and ?token= in the query), the tenant.
        r = a.request("POST", f"/api/sandboxes/{sid}/execute", {"code": "x = 41\nprint(x + 1)"})
        assert r.status == 200 and r.json()["stdout"] == "42\n", r.body
        with urllib.request.urlopen(f"{a.url}/api/sandboxes/{sid}?token={a.token}", timeout=60) as q:
            assert json.loads(q.read())["id"] == sid
        assert a.request("GET", f"/api/sandboxes/{tsid}", token=tenant).json()["owner"] == "acme8"
        assert a.request("GET", f"/api/sandboxes/{sid}", token=tenant).status == 404  # scoped as on B
        with pytest.raises(SandgateError):  # the websocket's upgrade too (recorded, not relayed)
            a.connect(sid)
        seen = list(relay_b.seen)
        assert len(seen) >= 4 and any(s["headers"].get("Upgrade") for s in seen), seen
        for s in seen:
            flat = json.dumps({k: v for k, v in s.items() if k != "body"})
            assert a.token not in flat and tenant not in flat and "Authorization" not in s["headers"], s
            assert s["headers"]["X-Sandgate-Fleet-Auth"].startswith("v1 ") and " to=node-b " in \
                s["headers"]["X-Sandgate-Fleet-Auth"], s
        execute = next(s for s in seen if s["method"] == "POST" and s["uri"].endswith("/execute"))
        assert send(b.url, execute) == 401  # replayed: its nonce was used
        assert send(a.url, execute) == 401  # signed for node-b, not node-a
        auth = execute["headers"]["X-Sandgate-Fleet-Auth"]
        fresh = " ".join(p if not p.startswith("nonce=") else "nonce=" + "0" * 32 for p in auth.split(" "))
        assert send(b.url, execute, {"X-Sandgate-Fleet-Auth": fresh}, b'{"code": "print(1)"}') == 401  # altered
        tenant_get = next(s for s in seen if s["headers"].get("X-Sandgate-Principal") == "tenant:acme8")
        assert send(b.url, tenant_get, {"X-Sandgate-Principal": "admin"}) == 401  # another principal
        # Without a signature, the principal header is nobody's word: the caller is its token.
        r = b.request("GET", f"/api/sandboxes/{sid}", token=tenant, headers={**here, "X-Sandgate-Principal": "admin"})
        assert r.status == 404, r.body
        r = b.request("GET", f"/api/sandboxes/{sid}", token="", headers={"X-Sandgate-Principal": "admin",
                                                                          "X-Sandgate-Fleet-Auth": "v1 forged"})
        assert r.status == 401, r.body
        assert "refused a forwarded request" in b.log_text()

        # Secret values: nowhere in Redis in clear (its append-only file holds every write).
        aof = redis.dir / "appendonlydir"
        wait_for(lambda: sid.encode() in b"".join(p.read_bytes() for p in aof.iterdir()), timeout=30)
        assert SECRET.encode() not in b"".join(p.read_bytes() for p in aof.iterdir())
        assert SECRET not in redis_cli(redis, "hget", f"sandgate:sb:{sid}", "record")

        # A Redis writer rewrites node-b's URL (B frozen, so its own heartbeat does not win the race).
        os.kill(b.proc.pid, signal.SIGSTOP)
        try:
            beat = json.loads(redis_cli(redis, "get", "sandgate:alive:node-b"))
            for forged in ({"url": listener.url, "capacity": 99, "sandboxes": 0},  # unsigned
                           {**beat, "url": listener.url, "capacity": 99}):  # B's signature, another URL
                redis_cli(redis, "set", "sandgate:alive:node-b", json.dumps(forged), "px", "60000")
                r = a.request("GET", f"/api/sandboxes/{sid}")
                assert r.status == 503 and "not signed" in r.json()["message"], r.body
                r = a.request("POST", f"/api/sandboxes/{tsid}/execute", {"code": "1"}, token=tenant)
                assert r.status == 503, r.body
                lst = a.request("GET", "/api/sandboxes")
                assert lst.status == 200 and sid not in [s["id"] for s in lst.json()]  # B left out, not asked
                made = a.request("POST", "/api/sandboxes", {})  # B "has room for 99": made on A instead
                assert made.status == 201, made.body
                assert a.request("GET", f"/api/sandboxes/{made.json()['id']}", headers=here).status == 200
                assert a.request("DELETE", f"/api/sandboxes/{made.json()['id']}").status == 204
            assert listener.seen == []
            assert "is not signed with this fleet key" in a.log_text()
        finally:
            os.kill(b.proc.pid, signal.SIGCONT)
        r = wait_for(lambda: (lambda r: r if r.status == 200 else None)(
            a.request("POST", f"/api/sandboxes/{sid}/execute", {"code": "print(x)"})), timeout=30)
        assert r.json()["stdout"] == "41\n" and listener.seen == []
        for i, tok in ((sid, a.token), (tsid, tenant)):
            assert a.request("DELETE", f"/api/sandboxes/{i}", token=tok).status == 204
    finally:
        for g in (a, b):
            if g:
                g.stop()
        relay_b.stop()
        listener.stop()


SECRET_BODY = {"egress": {"allow": ["api.secret.test:443"]},
               "secrets": [{"host": "api.secret.test", "header": "Authorization", "value": f"Bearer {SECRET}"}]}


# -- Redis AUTH, ACL users, TLS --------------------------------------------------------------------
class TcpRedis:
    """redis-server on a loopback TCP port (or a TLS one) with a config of the test's own."""

    def __init__(self, tmp, config: str, tls: bool = False):
        self.dir, self.port = tmp, free_port()
        (tmp / "redis.conf").write_text(config.format(port=self.port, dir=tmp))
        self.log = open(tmp / "redis.log", "w")
        self.proc = subprocess.Popen(["redis-server", str(tmp / "redis.conf")], stdout=self.log,
                                     stderr=subprocess.STDOUT)
        import socket

        def up():
            assert self.proc.poll() is None, (tmp / "redis.log").read_text()
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", self.port)) == 0
        wait_for(up, timeout=20)

    def stop(self):
        self.proc.terminate()
        self.proc.wait(20)
        self.log.close()


ACL_CONFIG = """bind 127.0.0.1
port {port}
dir {dir}
save ""
requirepass admin-pass-9f2c
user sgnode on >node-pass-41d7e2 ~sandgate:* &* +@all
user other on >other-pass-77 ~other:* +@all
"""


def test_redis_auth_and_acl_users(home, tmp_path):
    """A node logs in as an ACL user (``redis://user:password@host``) whose keys are ``sandgate:*``;
    its records are there. A wrong password or a user without those keys: the node does not start,
    and says why without the password. No log line holds a password."""
    server = TcpRedis(tmp_path, ACL_CONFIG)
    g = None
    try:
        url = f"redis://sgnode:node-pass-41d7e2@127.0.0.1:{server.port}/0"
        g = Gateway(home, tmp_path, env=node_env(url, SANDGATE_NODE_ID="node-a"))
        sid = g.request("POST", "/api/sandboxes", {}).json()["id"]
        keys = subprocess.run(["redis-cli", "-p", str(server.port), "--user", "sgnode", "--pass", "node-pass-41d7e2",
                               "--no-auth-warning", "--scan"], capture_output=True, text=True).stdout.split()
        assert f"sandgate:sb:{sid}" in keys, keys
        assert g.request("DELETE", f"/api/sandboxes/{sid}").status == 204
        assert "node-pass-41d7e2" not in g.log_text()
        for bad, why in ((f"redis://sgnode:wrong-pass-0@127.0.0.1:{server.port}/0", "wrong-pass-0"),
                         (f"redis://other:other-pass-77@127.0.0.1:{server.port}/0", "other-pass-77")):
            e = refused(home, tmp_path, node_env(bad, SANDGATE_NODE_ID="n-x"))
            assert "cannot use the session store redis://" in e and "[redacted]" in e and why not in e, e
    finally:
        if g:
            g.stop()
        server.stop()


def make_tls(tmp):
    """A CA and a server certificate for 127.0.0.1 it signed (PEM files), made here."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def cert(subject, issuer, key, sign_key, ca, san=None):
        b = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(key.public_key())
             .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
             .not_valid_after(now + datetime.timedelta(days=1))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if san:
            b = b.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return b.sign(sign_key, hashes.SHA256())

    ca_key, srv_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "sandgate test CA")])
    ca = cert(ca_name, ca_name, ca_key, ca_key, True)
    srv = cert(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]), ca_name, srv_key, ca_key, False,
               [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    pem = serialization.Encoding.PEM
    (tmp / "ca.pem").write_bytes(ca.public_bytes(pem))
    (tmp / "server.pem").write_bytes(srv.public_bytes(pem))
    (tmp / "server.key").write_bytes(srv_key.private_bytes(pem, serialization.PrivateFormat.TraditionalOpenSSL,
                                                           serialization.NoEncryption()))
    return tmp / "ca.pem"


TLS_CONFIG = """bind 127.0.0.1
port 0
tls-port {port}
dir {dir}
save ""
tls-cert-file {dir}/server.pem
tls-key-file {dir}/server.key
tls-ca-cert-file {dir}/ca.pem
tls-auth-clients no
requirepass tls-pass-5b1e
"""


def test_redis_over_tls_with_the_ca_setting(home, tmp_path):
    """``rediss://`` with SANDGATE_REDIS_CA_FILE: the node verifies the server's certificate against
    that CA and works; without the CA it refuses to start (the certificate is not trusted)."""
    ca = make_tls(tmp_path)
    server = TcpRedis(tmp_path, TLS_CONFIG)
    g = None
    try:
        url = f"rediss://:tls-pass-5b1e@127.0.0.1:{server.port}/0"
        e = refused(home, tmp_path, node_env(url, SANDGATE_NODE_ID="n-x"))
        assert "certificate verify failed" in e and "tls-pass-5b1e" not in e, e
        g = Gateway(home, tmp_path, env=node_env(url, SANDGATE_NODE_ID="node-a",
                                                  SANDGATE_REDIS_CA_FILE=str(ca)))
        sid = g.request("POST", "/api/sandboxes", {}).json()["id"]
        r = g.request("POST", f"/api/sandboxes/{sid}/execute", {"code": "print('over tls')"})
        assert r.json()["stdout"] == "over tls\n", r.body
        assert g.request("GET", "/api/fleet").json()["nodes"].keys() == {"node-a"}
        assert g.request("DELETE", f"/api/sandboxes/{sid}").status == 204
        assert "tls-pass-5b1e" not in g.log_text()
    finally:
        if g:
            g.stop()
        server.stop()
