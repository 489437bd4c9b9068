"""Tenants over HTTP on the in-process gateway: two tenants, each other's kernels,
sandboxes, checkpoints, files, websockets and sessions all 404; lists filtered;
the admin sees all; the token stored hashed; tenants kept across a gateway
restart; bad input 400. Quotas and the creation rate set by `serve`'s flags are
tests/test_tenant_quotas.py's; the service's side is test_tenants.py's."""

from __future__ import annotations

import pytest
import websocket

from conftest import Gateway, wait_for
from unit.inprocess import InProcessGateway


class As:
    """The gateway seen with another token (a tenant's)."""

    def __init__(self, gw: Gateway, token: str):
        self.gw, self.token, self.port = gw, token, gw.port

    def request(self, method, path, body=None, **kw):
        return self.gw.request(method, path, body, token=self.token, **kw)


def new_tenant(gw: Gateway, name: str, **quotas) -> As:
    r = gw.request("POST", "/api/tenants", {"name": name, **quotas})
    assert r.status == 201, r.body
    return As(gw, r.json()["token"])


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    g = InProcessGateway(tmp_path_factory.mktemp("tenants"), env={"SANDGATE_WARM_START": "false",
                                                               "SANDGATE_TENANT_CREATE_RATE": "0"})
    yield g
    g.stop()


def test_two_tenants_see_only_their_own(gw):
    alpha, beta = new_tenant(gw, "alpha"), new_tenant(gw, "beta")
    r = alpha.request("POST", "/api/kernels", {})
    assert r.status == 201, r.body
    k = r.json()["id"]
    r = beta.request("POST", "/api/sandboxes", {})
    assert r.status == 201, r.body
    kb = r.json()["id"]
    assert r.json()["owner"] == "beta"
    assert alpha.request("PUT", f"/api/sandboxes/{k}/files/notes.txt", raw=b"alpha only").status == 201
    weights = bytes(range(256)) * 1024  # 256 KiB both tenants will store
    assert alpha.request("PUT", f"/api/sandboxes/{k}/files/weights.bin", raw=weights).status == 201
    r = alpha.request("POST", f"/api/sandboxes/{k}/execute", {"code": "secret = 'alpha'; print(6 * 7)"})
    assert r.status == 200 and r.json()["stdout"] == "42\n"
    r = alpha.request("POST", f"/api/sandboxes/{k}/checkpoints", {"name": "mine"})
    assert r.status == 201, r.body
    cp = r.json()
    assert cp["owner"] == "alpha"
    r = alpha.request("POST", "/api/sessions", {"path": "a.ipynb", "type": "notebook", "kernel": {"id": k}})
    assert r.status == 201, r.body
    sess = r.json()["id"]

    # Everything of alpha's is 404 for beta, as an unknown id is.
    for method, path, body in [
            ("GET", f"/api/kernels/{k}", None), ("POST", f"/api/kernels/{k}/interrupt", {}),
            ("POST", f"/api/kernels/{k}/restart", {}), ("DELETE", f"/api/kernels/{k}", None),
            ("GET", f"/api/sandboxes/{k}", None), ("POST", f"/api/sandboxes/{k}/execute", {"code": "secret"}),
            ("POST", f"/api/sandboxes/{k}/pause", {}), ("POST", f"/api/sandboxes/{k}/resume", {}),
            ("GET", f"/api/sandboxes/{k}/checkpoints", None), ("POST", f"/api/sandboxes/{k}/checkpoints", {}),
            ("POST", f"/api/sandboxes/{k}/fork", {}), ("POST", f"/api/sandboxes/{kb}/fork", {"checkpoint": cp["id"]}),
            ("POST", "/api/sandboxes", {"checkpoint": cp["id"]}),
            ("GET", f"/api/sandboxes/{k}/files/notes.txt", None), ("GET", f"/api/sandboxes/{k}/files/", None),
            ("PUT", f"/api/sandboxes/{k}/files/x", {}), ("DELETE", f"/api/sandboxes/{k}/files/notes.txt", None),
            ("DELETE", f"/api/sandboxes/{k}", None), ("GET", f"/api/sessions/{sess}", None),
            ("PATCH", f"/api/sessions/{sess}", {"path": "stolen.ipynb"}), ("DELETE", f"/api/sessions/{sess}", None),
            ("POST", "/api/sessions", {"path": "b.ipynb", "type": "notebook", "kernel": {"id": k}})]:
        r = beta.request(method, path, body)
        assert r.status == 404, (method, path, r.status, r.body)
    with pytest.raises(websocket.WebSocketBadStatusException) as e:  # raw: the upgrade's own status is tested
        websocket.create_connection(f"ws://127.0.0.1:{gw.port}/api/kernels/{k}/channels",
                                    header=[f"Authorization: token {beta.token}"], timeout=30)
    assert e.value.status_code == 404

    # Lists: each its own; the admin all.
    assert [x["id"] for x in beta.request("GET", "/api/kernels").json()] == [kb]
    assert [x["id"] for x in beta.request("GET", "/api/sandboxes").json()] == [kb]
    assert beta.request("GET", "/api/sessions").json() == []
    assert [x["id"] for x in alpha.request("GET", "/api/kernels").json()] == [k]
    assert [x["id"] for x in alpha.request("GET", "/api/sessions").json()] == [sess]
    assert {x["id"] for x in gw.request("GET", "/api/sandboxes").json()} == {k, kb}
    assert {x["owner"] for x in gw.request("GET", "/api/sandboxes").json()} == {"alpha", "beta"}
    assert [x["id"] for x in gw.request("GET", "/api/sessions").json()] == [sess]

    # Alpha's kernel is untouched and its own websocket works; the admin reaches it too.
    c = gw.connect(k)
    c.ws.close()
    ws = websocket.create_connection(f"ws://127.0.0.1:{gw.port}/api/kernels/{k}/channels",
                                     header=[f"Authorization: token {alpha.token}"], timeout=60)
    ws.close()
    r = alpha.request("POST", f"/api/sandboxes/{k}/execute", {"code": "print(secret)"})
    assert r.status == 200 and r.json()["stdout"] == "alpha\n"
    assert gw.request("GET", f"/api/sandboxes/{k}/files/notes.txt").body == b"alpha only"
    r = alpha.request("GET", f"/api/sandboxes/{k}/checkpoints")
    assert [c["id"] for c in r.json()] == [cp["id"]]
    assert beta.request("GET", "/api/sandboxes/tree").json()["nodes"] == [
        {"kind": "sandbox", "id": kb, "parent": None, "state": "running"}]

    # The token is in the store only as a salted hash.
    db = b"".join(p.read_bytes() for p in gw.home.glob("sessions.db*"))
    for t in (alpha, beta):
        assert t.token.encode() not in db and t.token.split(".", 2)[2].encode() not in db
    assert b"alpha" in db and b"token_hash" in db

    # Deduplication inside a tenant only: beta storing alpha's bytes pays for all of them.
    again = alpha.request("POST", f"/api/sandboxes/{k}/checkpoints", {}).json()
    assert again["new_bytes"] < len(weights)  # alpha's own second checkpoint: the file is stored already
    assert beta.request("PUT", f"/api/sandboxes/{kb}/files/weights.bin", raw=weights).status == 201
    theirs = beta.request("POST", f"/api/sandboxes/{kb}/checkpoints", {}).json()
    assert theirs["owner"] == "beta" and theirs["new_bytes"] >= len(weights)

    # A tenant's token in the query string works, and is redacted in the access log like the admin's.
    assert gw.request("GET", f"/api/sandboxes?token={beta.token}", token="").json()[0]["id"] == kb
    # tornado writes its access line after the answer has gone out: wait for that line.
    wait_for(lambda: "token=[redacted]" in gw.log_text(), timeout=30)
    log = gw.log_text()
    assert beta.token not in log and alpha.token not in log

    # Deleting a tenant deletes its sandboxes; its token is refused from then on.
    r = gw.request("DELETE", "/api/tenants/beta")
    assert r.status == 200 and r.json()["sandboxes_deleted"] == [kb]
    assert beta.request("GET", "/api/sandboxes").status == 401
    assert [x["id"] for x in gw.request("GET", "/api/sandboxes").json()] == [k]
    assert gw.request("DELETE", "/api/tenants/alpha").json()["sandboxes_deleted"] == [k]


def test_tenant_admin_only_and_bad_input(gw):
    t = new_tenant(gw, "gamma", max_sandboxes=3)
    for body, field in (({"name": "No Spaces"}, "name"), ({"name": ""}, "name"), ({}, "name"),
                        ({"name": "a.b"}, "name"), ({"name": "ok", "max_memory_mb": -5}, "max_memory_mb"),
                        ({"name": "ok", "quota": 1}, "quota")):
        r = gw.request("POST", "/api/tenants", body)
        assert r.status == 400 and r.json()["message"].startswith(f"{field}:"), (body, r.body)
        assert "Traceback" not in r.body.decode()
    assert gw.request("POST", "/api/tenants", raw=b"[1]").status == 400
    assert gw.request("POST", "/api/tenants", {"name": "gamma"}).status == 409
    assert t.request("GET", "/api/tenants").status == 403
    assert t.request("POST", "/api/tenants", {"name": "delta"}).status == 403
    assert t.request("DELETE", "/api/tenants/gamma").status == 403
    listed = gw.request("GET", "/api/tenants").json()
    assert [(x["name"], x["max_sandboxes"]) for x in listed] == [("gamma", 3)]
    assert all("token" not in x for x in listed)
    assert gw.request("GET", "/api/tenants", token="sgt.gamma.not-the-secret").status == 401
    assert gw.request("DELETE", "/api/tenants/nope").status == 404
    assert gw.request("DELETE", "/api/tenants/gamma").status == 200


def test_tenants_survive_a_gateway_restart(tmp_path):
    g = InProcessGateway(tmp_path, env={"SANDGATE_WARM_START": "false"})
    try:
        t = new_tenant(g, "kept", max_memory_mb=4096)
        assert t.request("GET", "/api/sandboxes").status == 200
    finally:
        g.stop()
    g2 = InProcessGateway(tmp_path, env={"SANDGATE_WARM_START": "false"}, own_home=g.home)
    try:
        t2 = As(g2, t.token)
        assert t2.request("GET", "/api/sandboxes").status == 200
        assert g2.request("GET", "/api/sandboxes", token=t.token[:-2] + "xx").status == 401
        assert [(x["name"], x["max_memory_mb"]) for x in g2.request("GET", "/api/tenants").json()] == [("kept", 4096)]
    finally:
        g2.stop()
