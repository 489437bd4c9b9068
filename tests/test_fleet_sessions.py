"""Jupyter sessions across a fleet: a real redis-server and two real gateway
processes. A session made on node A is listed, fetched, renamed and deleted
through node B; deleting it stops its kernel on A."""

from __future__ import annotations

from conftest import Gateway
from test_fleet import fleet_env, redis  # noqa: F401 (the fixture)


def test_a_session_made_on_one_node_is_served_by_another(home, tmp_path, redis):  # noqa: F811
    common = fleet_env(redis)
    a = Gateway(home, tmp_path, env={**common, "SANDGATE_NODE_ID": "node-a"})
    b = Gateway(home, tmp_path, env={**common, "SANDGATE_NODE_ID": "node-b"})
    try:
        r = a.request("POST", "/api/sessions", {"path": "n.ipynb", "type": "notebook", "kernel": {"name": "python3"}})
        assert r.status == 201, r.body
        s = r.json()
        kid = s["kernel"]["id"]
        assert a.request("GET", f"/api/kernels/{kid}").status == 200  # the kernel runs on A
        assert s["id"] in [x["id"] for x in b.request("GET", "/api/sessions").json()]
        got = b.request("GET", f"/api/sessions/{s['id']}")
        assert got.status == 200 and got.json()["kernel"]["id"] == kid, got.body
        assert got.json()["kernel"]["node"] == "node-a"  # from the kernel's record
        # POST of the same path through B: the same session, no second kernel.
        again = b.request("POST", "/api/sessions", {"path": "n.ipynb", "type": "notebook"})
        assert again.status == 201 and again.json()["id"] == s["id"]
        r = b.request("PATCH", f"/api/sessions/{s['id']}", {"path": "renamed.ipynb", "name": "renamed"})
        assert r.status == 200 and r.json()["path"] == "renamed.ipynb", r.body
        assert a.request("GET", f"/api/sessions/{s['id']}").json()["path"] == "renamed.ipynb"
        # A session made on B cannot be moved onto A's path, from either node.
        other = b.request("POST", "/api/sessions", {"path": "o.ipynb", "type": "notebook",
                                                    "kernel": {"id": kid}}).json()
        r = a.request("PATCH", f"/api/sessions/{other['id']}", {"path": "renamed.ipynb"})
        assert r.status == 409 and "taken by another session" in r.json()["message"]
        assert b.request("DELETE", f"/api/sessions/{s['id']}").status == 204
        assert a.request("GET", f"/api/kernels/{kid}").status == 404  # stopped on its node
        assert a.request("GET", f"/api/sessions/{s['id']}").status == 404
        # The other session shared that kernel: it went with it.
        assert b.request("GET", "/api/sessions").json() == []
    finally:
        a.stop()
        b.stop()
