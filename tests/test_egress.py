"""Egress end to end: a real `sandgate serve` whose sandboxes (real runsc, and qemu for the basic path)
reach HTTPS and HTTP servers on host loopback (127.0.0.3/127.0.0.4) only through the gateway's egress
proxy, as their policy allows, with secrets added by the proxy and never seen inside.

Names resolve through SANDGATE_EGRESS_HOSTS (the proxy's own table, as /etc/hosts); the upstream's test
CA reaches the proxy through SANDGATE_EGRESS_CA_BUNDLE. Loopback addresses are refused unless a rule
names them, so the policies here carry "127.0.0.4/32" beside the names they allow."""

from __future__ import annotations

import json

import pytest

from conftest import Gateway
from test_egress_proxy import PLAIN_IP, TLS_IP, upstream  # noqa: F401 (the HTTPS/HTTP servers, a fixture)

TOKEN_VALUE = "Bearer sk-test-never-inside-1234"
KEY_VALUE = "real-key-never-inside-5678"


def egress_env(upstream):
    return {"SANDGATE_EGRESS_CA_BUNDLE": str(upstream["ca"]),
            "SANDGATE_EGRESS_HOSTS": f"secure.test={TLS_IP},other.test={TLS_IP},plain.test={PLAIN_IP}"}


@pytest.fixture(scope="module")
def egw(home, upstream, tmp_path_factory):
    g = Gateway(home, tmp_path_factory.mktemp("egress"), env=egress_env(upstream))
    yield g
    g.stop()


def ex(gw, sid, code):
    out = gw.run_code(sid, code)  # the SDK (conftest)
    assert out.error is None, out.error
    return out.stdout


# Fetch a URL through whatever proxy the environment names now (a fresh opener each time: urllib's
# global one reads the environment once); prints "status body".
FETCH = r"""
import os, urllib.request, urllib.error
def fetch(url, headers={}):
    opener = urllib.request.build_opener()
    try:
        with opener.open(urllib.request.Request(url, headers=headers), timeout=30) as r:
            return f"{r.status} {r.read().decode()}"
    except urllib.error.HTTPError as e:
        return f"{e.code} {e.read().decode()}"
    except OSError as e:
        return f"error {e}"

def connect(host, port):  # a raw CONNECT: urllib hides a refused tunnel's body
    import socket
    proxy_port = int(os.environ["HTTPS_PROXY"].rsplit(":", 1)[1].rstrip("/"))
    with socket.create_connection(("127.0.0.1", proxy_port), timeout=30) as s:
        s.sendall(f"CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return data.decode(errors="replace")
"""


def policy(upstream, *extra):
    return {"allow": [f"secure.test:{upstream['https']}", f"{TLS_IP}/32", *extra]}


SECRETS = [{"host": "secure.test", "header": "Authorization", "value": TOKEN_VALUE},
           {"host": "secure.test", "name": "API_KEY", "value": KEY_VALUE}]


def test_a_sandbox_reaches_what_its_policy_allows_with_secrets_added_outside(egw, upstream):
    r = egw.request("POST", "/api/sandboxes", {"egress": policy(upstream), "secrets": SECRETS})
    assert r.status == 201, r.body
    sb = r.json()
    sid, url = sb["id"], f"https://secure.test:{upstream['https']}/hello"
    try:
        # The model shows where secrets go, never what they are.
        assert sb["egress"]["allow"][0] == f"secure.test:{upstream['https']}"
        assert sb["secrets"] == [{"host": "secure.test", "header": "Authorization", "name": None},
                                 {"host": "secure.test", "header": None, "name": "API_KEY"}]
        assert TOKEN_VALUE not in r.body.decode() and KEY_VALUE not in r.body.decode()
        out = ex(egw, sid, FETCH + f"print(fetch({url!r}, {{'X-Key': os.environ['API_KEY']}}))")
        status, body = out.split(" ", 1)
        assert status == "200", out
        seen = json.loads(body)["headers"]
        assert seen["Authorization"] == TOKEN_VALUE  # added by the proxy
        assert seen["X-Key"] == KEY_VALUE  # the placeholder swapped on the way out
        # Inside there is only the placeholder, and the proxy's CA in the trusted bundle.
        inside = ex(egw, sid, "import os, glob\n"
                              "print(os.environ['API_KEY'])\n"
                              "print(os.environ['HTTPS_PROXY'], os.environ['SSL_CERT_FILE'])\n"
                              "blob = b''\n"
                              "for p in glob.glob('/proc/[0-9]*/environ') + glob.glob('/proc/[0-9]*/cmdline'):\n"
                              "    try: blob += open(p, 'rb').read()\n"
                              "    except OSError: pass\n"
                              f"print({TOKEN_VALUE.encode()!r} in blob, {KEY_VALUE.encode()!r} in blob)\n")
        placeholder, proxy_line, leaked = inside.splitlines()
        assert placeholder.startswith("sandgate-ph-") and placeholder != KEY_VALUE
        assert proxy_line.startswith("http://127.0.0.1:")
        assert leaked == "False False"
        # Refused: a name no rule allows (resolvable, same address), and a port no rule allows.
        other = ex(egw, sid, FETCH + f"print(connect('other.test', {upstream['https']}))")
        assert other.startswith("HTTP/1.1 403") and "no allow rule matched other.test" in other, other
        plain = ex(egw, sid, FETCH + f"print(fetch('http://plain.test:{upstream['http']}/'))")
        assert plain.startswith("403 "), plain
        # The placeholder sent to a host that is not the secret's stays a placeholder.
        sent = ex(egw, sid, FETCH + f"print(fetch('https://secure.test:{upstream['https']}/', "
                                    "{'X-Key': os.environ['API_KEY']}))")
        assert KEY_VALUE in sent  # its own host: swapped (the echo shows it)
        log = egw.log_text()
        assert TOKEN_VALUE not in log and KEY_VALUE not in log
        assert f"sandbox {sid}: GET secure.test:{upstream['https']} allowed" in log
        assert f"sandbox {sid}: GET other.test:{upstream['https']} refused" in log or \
               f"sandbox {sid}: CONNECT other.test:{upstream['https']} refused" in log, log[-2000:]
    finally:
        egw.request("DELETE", f"/api/sandboxes/{sid}")


def test_the_policy_changes_while_it_runs_and_survives_a_checkpoint_and_a_fork(egw, upstream):
    sid = egw.request("POST", "/api/sandboxes", {"egress": policy(upstream), "secrets": SECRETS[:1]}).json()["id"]
    url = f"https://secure.test:{upstream['https']}/"
    fork = None
    try:
        assert ex(egw, sid, FETCH + f"print(fetch({url!r}))").startswith("200 ")
        r = egw.request("PATCH", f"/api/sandboxes/{sid}/egress",
                        {"allow": policy(upstream)["allow"], "deny": ["secure.test"]})
        assert r.status == 200 and r.json()["egress"]["deny"] == ["secure.test"], r.body
        denied = ex(egw, sid, FETCH + f"print(connect('secure.test', {upstream['https']}))")
        assert denied.startswith("HTTP/1.1 403") and "denied by rule 'secure.test'" in denied, denied  # deny wins
        egw.request("PATCH", f"/api/sandboxes/{sid}/egress", policy(upstream))
        assert egw.request("GET", f"/api/sandboxes/{sid}/egress").json() == {**policy(upstream), "deny": []}
        # runsc cannot checkpoint a socket: the agent closes its listener around it and opens it after.
        assert egw.request("POST", f"/api/sandboxes/{sid}/checkpoints", {}).status == 201
        assert ex(egw, sid, FETCH + f"print(fetch({url!r}))").startswith("200 ")
        r = egw.request("POST", f"/api/sandboxes/{sid}/fork", {})
        assert r.status == 201, r.body
        fork = r.json()["id"]
        assert r.json()["egress"] == {**policy(upstream), "deny": []} and len(r.json()["secrets"]) == 1
        got = ex(egw, fork, FETCH + f"print(fetch({url!r}))")
        assert got.startswith("200 ") and TOKEN_VALUE in got, got  # the fork's requests carry the secret too
    finally:
        for s in (sid, fork):
            if s:
                egw.request("DELETE", f"/api/sandboxes/{s}")


def test_without_a_policy_a_sandbox_has_no_network_at_all(egw):
    sid = egw.create()["id"]
    try:
        out = ex(egw, sid, "import os, socket\n"
                           "print(sorted(k for k in os.environ if 'proxy' in k.lower()))\n"
                           "s = socket.socket()\n"
                           "print(s.connect_ex(('127.0.0.1', 3128)) != 0)\n")
        assert out.splitlines() == ["[]", "True"]
        assert egw.request("GET", f"/api/sandboxes/{sid}/egress").json() is None
    finally:
        egw.request("DELETE", f"/api/sandboxes/{sid}")


@pytest.mark.parametrize("body, field", [
    ({"egress": {"allow": ["not a rule!"]}}, "egress.allow"),
    ({"egress": {"allow": ["10.0.0.0/33"]}}, "egress.allow"),
    ({"egress": {"allow": [], "nope": 1}}, "egress.nope"),
    ({"egress": {}, "secrets": [{"host": "a.test", "header": "Bad Header", "value": "sk-leak-1"}]}, "secrets.0.header"),
    ({"egress": {}, "secrets": [{"host": "a.test", "header": "X", "value": "sk-leak-1", "extra": 1}]}, "secrets.0.extra"),
    ({"egress": {}, "secrets": [{"host": "a.test", "value": "sk-leak-1"}]}, "secrets.0"),
])
def test_bad_policies_and_secrets_are_400s_naming_the_field_and_never_echo_a_value(egw, body, field):
    r = egw.request("POST", "/api/sandboxes", body)
    assert r.status == 400, r.body
    assert field in r.json()["message"], r.body
    assert b"sk-leak-1" not in r.body


def test_secrets_need_a_policy_and_a_patch_is_checked_too(egw, upstream):
    r = egw.request("POST", "/api/sandboxes", {"secrets": SECRETS[:1]})
    assert r.status == 400 and "egress" in r.json()["message"], r.body
    sid = egw.create()["id"]
    try:
        r = egw.request("PATCH", f"/api/sandboxes/{sid}/egress", {"allow": ["*.*.bad*"]})
        assert r.status == 400 and "allow" in r.json()["message"], r.body
        # A sandbox that had no network gets its listener from its first policy.
        assert egw.request("PATCH", f"/api/sandboxes/{sid}/egress", policy(upstream)).status == 200
        url = f"https://secure.test:{upstream['https']}/"
        assert ex(egw, sid, FETCH + f"print(fetch({url!r}))").startswith("200 ")
    finally:
        egw.request("DELETE", f"/api/sandboxes/{sid}")


def test_policy_and_secrets_survive_a_gateway_restart(home, upstream, tmp_path):
    env = {**egress_env(upstream), "SANDGATE_KEEP_SANDBOXES": "true"}
    g = Gateway(home, tmp_path, env=env)
    try:
        sid = g.request("POST", "/api/sandboxes", {"egress": policy(upstream), "secrets": SECRETS}).json()["id"]
        ex(g, sid, "x = 1")
    finally:
        g.stop()  # SIGTERM: paused to disk
    g2 = Gateway(home, tmp_path, own_home=g.home, env=env)
    try:
        url = f"https://secure.test:{upstream['https']}/"
        got = ex(g2, sid, FETCH + f"print(fetch({url!r}, {{'X-Key': os.environ['API_KEY']}}))")
        assert got.startswith("200 ") and TOKEN_VALUE in got and KEY_VALUE in got, got
        assert g2.request("DELETE", f"/api/sandboxes/{sid}").status == 204
    finally:
        g2.stop()


def test_egress_works_in_a_vm(home, upstream, tmp_path):
    from sandgate_images import vm

    vm.build(home)
    g = Gateway(home, tmp_path, env={**egress_env(upstream), "SANDGATE_WARM_START": "false"})
    try:
        r = g.request("POST", "/api/sandboxes", {"driver": "qemu", "egress": policy(upstream), "secrets": SECRETS})
        assert r.status == 201, r.body
        sid = r.json()["id"]
        url = f"https://secure.test:{upstream['https']}/"
        got = ex(g, sid, FETCH + f"print(fetch({url!r}, {{'X-Key': os.environ['API_KEY']}}))")
        assert got.startswith("200 ") and TOKEN_VALUE in got and KEY_VALUE in got, got
        assert ex(g, sid, FETCH + f"print(connect('other.test', {upstream['https']}))").startswith("HTTP/1.1 403")
    finally:
        g.stop()
