"""Hazards at the API's edges: credentials in log lines, labels without a bound, and file names and
trees that could give a 500 (or a minute of work first). One real
gateway with gVisor sandboxes for the module; every refusal is a 4xx that names its limit."""

from __future__ import annotations

import json
import urllib.parse
import uuid

import pytest
import websocket

from conftest import Gateway, wait_for

from sandgate_client import BadRequest, Sandbox

TOKEN = "edges-" + uuid.uuid4().hex  # its own, so that finding it in the log can mean only a leak


@pytest.fixture(scope="module")
def gw(home, tmp_path_factory):
    g = Gateway(home, tmp_path_factory.mktemp("edges"), token=TOKEN)
    yield g
    g.stop()


@pytest.fixture(scope="module")
def sb(gw):
    # Labels at every bound (64 of them, 128-character keys, 1024-character values) are accepted.
    labels = {f"{i:03d}".ljust(128, "k"): "v" * 1024 for i in range(64)}
    r = gw.request("POST", "/api/sandboxes", {"labels": labels})
    assert r.status == 201, r.body[:300]
    assert r.json()["labels"] == labels
    sid = r.json()["id"]
    yield sid
    gw.request("DELETE", f"/api/sandboxes/{sid}")


def e2b(gw, sid, method, path, body=None, raw=None, headers=None):
    """An envd call as the e2b SDK makes it: the sandbox and port in headers, the admin's key."""
    h = {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49983", "X-API-KEY": gw.token, **(headers or {})}
    return gw.request(method, "/e2b" + path, body, token="", headers=h, raw=raw)


def run(gw, sid, code):
    r = gw.request("POST", f"/api/sandboxes/{sid}/execute", {"code": code, "timeout": 300})
    assert r.status == 200 and r.json()["status"] == "ok", r.body[:2000]
    return r.json()["stdout"]


# -- no credential in any log line ------------------------------------------------------------
def test_no_log_line_carries_a_credential(gw):
    tenant = gw.request("POST", "/api/tenants", {"name": "edges"}).json()["token"]
    missing = str(uuid.uuid4())
    # A websocket 404 (logged by tornado.general, with the URL), one with the token mid-query, a
    # tenant's token, and a 401; REST and E2B URLs with every credential name the gateway reads.
    for query in (f"token={TOKEN}", f"session_id=s&token={TOKEN}&x=1", f"token={tenant}", "token=wrong-guess"):
        with pytest.raises(websocket.WebSocketBadStatusException):
            websocket.create_connection(f"ws://127.0.0.1:{gw.port}/api/kernels/{missing}/channels?{query}")
    assert gw.request("GET", f"/api/kernels/{missing}?token={TOKEN}", token="").status == 404
    assert gw.request("GET", f"/e2b/sandboxes/{missing}?api_key={TOKEN}&access_token={tenant}", token="").status == 401
    assert gw.request("GET", f"/api/nowhere?token={tenant}", token="").status == 404
    # the last request's access line (written once its answer is out, so waited for): every line before it is in
    def logged():
        text = gw.log_text()
        return text if "/api/nowhere?token=[redacted]" in text else None
    log = wait_for(logged, 30)
    general = [line for line in log.splitlines() if "tornado.general" in line and "/channels?" in line]
    assert len(general) >= 3 and all("token=[redacted]" in line for line in general), general  # the 404s' own lines
    for secret in (TOKEN, tenant, tenant.split(".")[-1], "wrong-guess"):
        assert secret not in log, [line for line in log.splitlines() if secret in line]


# -- labels are bounded ----------------------------------------------------------------------
def test_labels_and_metadata_are_bounded(gw, sb):
    before = len(gw.request("GET", "/api/sandboxes").json())
    for labels, limit in (({str(i): "x" for i in range(65)}, "at most 64"),
                          ({"k" * 129: "v"}, "1-128 characters"),
                          ({"k": "v" * (2 << 20)}, "at most 1024 characters"),
                          ({"": "v"}, "1-128 characters")):
        r = gw.request("POST", "/api/sandboxes", {"labels": labels})
        assert r.status == 400 and limit in r.json()["message"], r.body[:300]
        assert len(r.body) < 1000  # the refusal does not quote what it refuses
    with pytest.raises(BadRequest, match="at most 64"):  # the SDK's (and the MCP server's) path
        Sandbox.create(gw.url, gw.token, labels={str(i): "x" for i in range(100)})
    # E2B's metadata become labels beside the template's own: 63 of them.
    r = gw.request("POST", "/e2b/sandboxes", {"metadata": {str(i): "x" for i in range(20_000)}}, token="",
                   headers={"X-API-KEY": gw.token})
    assert r.status == 400 and "at most 63" in r.json()["message"], r.body[:300]
    r = gw.request("POST", "/e2b/sandboxes", {"templateID": "t" * 5000}, token="", headers={"X-API-KEY": gw.token})
    assert r.status == 400 and "1024" in r.json()["message"], r.body[:300]
    assert len(gw.request("GET", "/api/sandboxes").json()) == before  # nothing was started for them
    r = gw.request("POST", "/e2b/sandboxes", {"metadata": {str(i): "x" for i in range(63)}}, token="",
                   headers={"X-API-KEY": gw.token})
    assert r.status == 201, r.body[:300]
    gw.request("DELETE", f"/api/sandboxes/{r.json()['sandboxID']}")


# -- file names, deep and wide trees ---------------------------------------------------------
def test_a_name_past_the_file_systems_limit_is_a_400(gw, sb):
    long, ok = "n" * 300, "m" * 250
    for method, body in (("PUT", b"x"), ("GET", None), ("DELETE", None)):  # the PUT makes d/
        for path in (long, f"d/{long}/f"):
            r = gw.request(method, f"/api/sandboxes/{sb}/files/{path}", raw=body)
            assert r.status == 400 and "255 bytes" in r.json()["message"], (method, path[:10], r.status, r.body[:300])
    q = urllib.parse.quote(long)
    r = e2b(gw, sb, "GET", f"/files?path={q}")
    assert r.status == 400 and "255 bytes" in r.json()["message"], r.body[:300]
    r = e2b(gw, sb, "POST", f"/files?path={q}", raw=b"x", headers={"Content-Type": "application/octet-stream"})
    assert r.status == 400 and "255 bytes" in r.json()["message"], r.body[:300]
    for method in ("ListDir", "Stat", "Remove"):
        r = e2b(gw, sb, "POST", f"/filesystem.Filesystem/{method}", {"path": f"{long}/x" if method == "Stat" else long})
        assert r.status == 400 and r.json()["code"] == "invalid_argument", (method, r.status, r.body[:300])
    # A name within the limit is written, read and listed (the temporary name once overflowed it).
    assert gw.request("PUT", f"/api/sandboxes/{sb}/files/{ok}", raw=b"fits").status == 201
    assert gw.request("GET", f"/api/sandboxes/{sb}/files/{ok}").body == b"fits"
    r = e2b(gw, sb, "POST", f"/files?path={ok[:-1]}2", raw=b"e2b", headers={"Content-Type": "application/octet-stream"})
    assert r.status == 200, r.body[:300]
    names = [e["name"] for e in gw.request("GET", f"/api/sandboxes/{sb}/files/").json()["entries"]]
    assert ok in names and ok[:-1] + "2" in names and not [n for n in names if "sandgate" in n]


# os.makedirs recurses once per level: a loop instead.
DEEP = ("import os\nos.mkdir('{0}'); os.chdir('{0}')\nfor i in range(1500): os.mkdir('d'); os.chdir('d')\n"
        "os.chdir('/workspace')\n")


def test_a_deep_tree_is_listed_within_bounds_and_deleted(gw, sb):
    # 1,500 levels and a directory of 1,001: one cell.
    run(gw, sb, DEEP.format("deep") + "for i in range(1001): os.makedirs(f'wide/{i}')")
    r = e2b(gw, sb, "POST", "/filesystem.Filesystem/ListDir", {"path": "deep", "depth": 100_000})
    assert r.status == 400 and "limit of 32" in r.json()["message"], r.body[:300]
    r = e2b(gw, sb, "POST", "/filesystem.Filesystem/ListDir", {"path": "/workspace/deep", "depth": 32})
    assert r.status == 200, r.body[:300]
    assert [e["path"] for e in r.json()["entries"]] == ["/workspace/deep" + "/d" * i for i in range(1, 33)]
    r = e2b(gw, sb, "POST", "/filesystem.Filesystem/ListDir", {"path": "wide", "depth": 2})
    assert r.status == 400 and "more than 1000 directories" in r.json()["message"], r.body[:300]
    # Deleting it: the sandbox API's, then E2B's on a second one.
    assert gw.request("DELETE", f"/api/sandboxes/{sb}/files/deep").status == 204
    run(gw, sb, DEEP.format("deep2"))
    r = e2b(gw, sb, "POST", "/filesystem.Filesystem/Remove", {"path": "deep2"})
    assert r.status == 200, r.body[:300]
    assert run(gw, sb, "import os\nprint(os.path.exists('deep'), os.path.exists('deep2'))") == "False False\n"


def test_a_listing_past_the_agent_protocols_bound_is_refused_at_once(gw, sb):
    run(gw, sb, "import os\nos.makedirs('big')\nfor i in range(6000): open(f'big/{i:0200d}', 'w').close()")
    r = gw.request("GET", f"/api/sandboxes/{sb}/files/big", timeout=30)  # it was a 60 s wait, then a 503
    assert r.status == 403 and "1 MiB" in r.json()["message"] and "subdirectories" in r.json()["message"], r.body[:300]
    r = e2b(gw, sb, "POST", "/filesystem.Filesystem/ListDir", {"path": "big"})
    assert r.status == 403 and "1 MiB" in json.loads(r.body)["message"], r.body[:300]
    assert gw.request("DELETE", f"/api/sandboxes/{sb}/files/big").status == 204
