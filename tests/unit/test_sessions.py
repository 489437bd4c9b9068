"""Jupyter sessions (/api/sessions) as session store records: a path is one
session's per tenant (409 when a PATCH moves onto another's), a tenant sees
its own only, and a restarted gateway still has them."""

import pytest

from unit.inprocess import InProcessGateway
from unit.test_tenants_gateway import new_tenant


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    g = InProcessGateway(tmp_path_factory.mktemp("sessions"), env={"SANDGATE_WARM_START": "false",
                                                                "SANDGATE_TENANT_CREATE_RATE": "0",
                                                                "SANDGATE_KEEP_SANDBOXES": "true"})
    yield g
    g.stop()


def create(gw, path, **kw):
    r = gw.request("POST", "/api/sessions", {"path": path, "type": "notebook", "kernel": {"name": "python3"}}, **kw)
    assert r.status == 201, r.body
    return r.json()


def test_patch_onto_a_taken_path_is_409(gw):
    a, b = create(gw, "p/a.ipynb"), create(gw, "p/b.ipynb")
    r = gw.request("PATCH", f"/api/sessions/{b['id']}", {"path": "p/a.ipynb"})
    assert r.status == 409 and "p/a.ipynb is taken by another session" in r.json()["message"]
    assert gw.request("GET", f"/api/sessions/{b['id']}").json()["path"] == "p/b.ipynb"
    # POST of a taken path answers with the session holding it (jupyter_server's behaviour).
    assert create(gw, "p/a.ipynb")["id"] == a["id"]
    # Renaming frees the old path.
    assert gw.request("PATCH", f"/api/sessions/{a['id']}", {"path": "p/c.ipynb"}).status == 200
    assert gw.request("PATCH", f"/api/sessions/{b['id']}", {"path": "p/a.ipynb"}).status == 200
    # A new kernel name: a new kernel, the old one stopped.
    r = gw.request("PATCH", f"/api/sessions/{b['id']}", {"kernel": {"name": "python3"}})
    assert r.status == 200 and r.json()["kernel"]["id"] != b["kernel"]["id"]
    assert gw.request("GET", f"/api/kernels/{b['kernel']['id']}").status == 404
    for s in (a, r.json()):
        assert gw.request("DELETE", f"/api/sessions/{s['id']}").status == 204


def test_a_deleted_kernel_takes_its_session_along(gw):
    s = create(gw, "gone.ipynb")
    assert gw.request("DELETE", f"/api/kernels/{s['kernel']['id']}").status == 204
    assert gw.request("GET", f"/api/sessions/{s['id']}").status == 404
    assert s["id"] not in [x["id"] for x in gw.request("GET", "/api/sessions").json()]
    assert create(gw, "gone.ipynb")["id"] != s["id"]  # the path is free again


def test_tenants_see_their_own_sessions(gw):
    alpha, beta = new_tenant(gw, "salpha"), new_tenant(gw, "sbeta")
    sa, sb = create(alpha, "same.ipynb"), create(beta, "same.ipynb")  # paths are per tenant
    assert sa["id"] != sb["id"]
    assert [x["id"] for x in alpha.request("GET", "/api/sessions").json()] == [sa["id"]]
    assert beta.request("GET", f"/api/sessions/{sa['id']}").status == 404
    assert beta.request("PATCH", f"/api/sessions/{sa['id']}", {"path": "x.ipynb"}).status == 404
    assert beta.request("DELETE", f"/api/sessions/{sa['id']}").status == 404
    r = beta.request("POST", "/api/sessions", {"path": "y.ipynb", "type": "notebook", "kernel": {"id": sa["kernel"]["id"]}})
    assert r.status == 404  # another tenant's kernel
    admin_ids = [x["id"] for x in gw.request("GET", "/api/sessions").json()]
    assert sa["id"] in admin_ids and sb["id"] in admin_ids
    for t, s in ((alpha, sa), (beta, sb)):
        assert t.request("DELETE", f"/api/sessions/{s['id']}").status == 204


def test_sessions_survive_a_restart(gw, tmp_path):
    s = create(gw, "kept.ipynb")
    gw.stop()
    g2 = InProcessGateway(tmp_path, own_home=gw.home, env={"SANDGATE_WARM_START": "false",
                                                        "SANDGATE_KEEP_SANDBOXES": "true"})
    try:
        back = g2.request("GET", f"/api/sessions/{s['id']}")
        assert back.status == 200, back.body
        assert back.json()["path"] == "kept.ipynb" and back.json()["kernel"]["id"] == s["kernel"]["id"]
        assert g2.request("DELETE", f"/api/sessions/{s['id']}").status == 204
    finally:
        g2.stop()
