"""The Jupyter Kernel Gateway REST surface: its shapes, statuses and bookkeeping, on the in-process gateway."""

import datetime as dt
import uuid

from unit.inprocess import InProcessGateway

UNKNOWN = str(uuid.uuid4())


def test_api_version_and_kernelspecs(gateway):
    assert gateway.request("GET", "/api").json()["version"]
    specs = gateway.request("GET", "/api/kernelspecs").json()
    assert specs["default"] == "python3"
    assert {"python3", "python3-gvisor"} <= set(specs["kernelspecs"])
    one = specs["kernelspecs"]["python3"]
    assert one["name"] == "python3" and one["spec"]["language"] == "python" and "resources" in one
    assert gateway.request("GET", "/api/kernelspecs/python3").json()["spec"]["display_name"].startswith("Python 3")
    r = gateway.request("GET", "/api/kernelspecs/nope")
    assert r.status == 404 and r.json() == {"reason": "Not Found", "message": "Kernel spec nope not found",
                                            "code": "not_found"}


def test_token_auth(gateway):
    for token in ("", "wrong"):
        r = gateway.request("GET", "/api/kernels", token=token)
        assert r.status == 401 and r.json()["reason"] == "Unauthorized"
    assert gateway.request("GET", f"/api/kernels?token={gateway.token}", token="").status == 200
    assert gateway.request("GET", "/api/kernels", token="", headers={"Authorization": f"Bearer {gateway.token}"}).status == 200
    # A preflight carries no token; it must not be refused for that.
    assert gateway.request("OPTIONS", "/api/kernels", token="").status == 204


def test_cors_when_enabled(tmp_path):
    gw = InProcessGateway(tmp_path, env={"SANDGATE_ALLOW_ORIGIN": "http://app.example"})
    try:
        r = gw.request("OPTIONS", "/api/kernels", token="", headers={"Origin": "http://app.example"})
        assert r.status == 204
        assert r.headers["Access-Control-Allow-Origin"] == "http://app.example"
        assert "Authorization" in r.headers["Access-Control-Allow-Headers"]
        r = gw.request("GET", "/api/kernels", headers={"Origin": "http://other.example"})
        assert r.status == 200 and "Access-Control-Allow-Origin" not in r.headers
    finally:
        gw.stop()


def test_bad_bodies_get_400(gateway):
    r = gateway.request("POST", "/api/kernels", raw=b"{bad")
    assert r.status == 400 and r.json() == {"reason": "Bad Request", "message": "Invalid JSON in body of request"}
    r = gateway.request("POST", "/api/kernels", {"name": "python3", "env": "notadict"})
    assert r.status == 400 and "env" in r.json()["message"]
    r = gateway.request("POST", "/api/kernels", raw=b"[1, 2]")
    assert r.status == 400 and "JSON object" in r.json()["message"]


def test_unknown_kernel_name_and_id(gateway):
    r = gateway.request("POST", "/api/kernels", {"name": "nope"})
    assert r.status == 404 and r.json()["message"] == "No such kernel named nope"
    for method, path in (("GET", ""), ("DELETE", ""), ("POST", "/interrupt"), ("POST", "/restart")):
        r = gateway.request(method, f"/api/kernels/{UNKNOWN}{path}", {} if method == "POST" else None)
        assert r.status == 404, (method, path)
        assert r.json()["message"] == f"Kernel does not exist: {UNKNOWN}"
    assert gateway.request("GET", "/api/kernels/not-a-uuid").status == 404
    r = gateway.request("GET", "/no/such/endpoint")
    assert r.status == 404 and r.json()["reason"] == "Not Found"


def test_kernel_lifecycle(gateway):
    r = gateway.request("POST", "/api/kernels", {})
    assert r.status == 201
    k = r.json()
    assert r.headers["Location"] == f"/api/kernels/{k['id']}"
    assert set(k) >= {"id", "name", "last_activity", "execution_state", "connections"}
    assert k["name"] == "python3" and k["connections"] == 0
    dt.datetime.strptime(k["last_activity"], "%Y-%m-%dT%H:%M:%S.%fZ")  # what GatewayClient parses
    assert k["id"] in [x["id"] for x in gateway.request("GET", "/api/kernels").json()]
    assert gateway.request("GET", f"/api/kernels/{k['id']}").json()["id"] == k["id"]
    assert gateway.request("POST", f"/api/kernels/{k['id']}/interrupt", {}).status == 204
    r = gateway.request("POST", f"/api/kernels/{k['id']}/restart", {})
    assert r.status == 200 and r.json()["id"] == k["id"] and r.json()["execution_state"] == "idle"
    assert gateway.request("DELETE", f"/api/kernels/{k['id']}").status == 204
    assert gateway.request("GET", f"/api/kernels/{k['id']}").status == 404
    assert gateway.request("DELETE", f"/api/kernels/{k['id']}").status == 404


def test_max_kernels(tmp_path):
    gw = InProcessGateway(tmp_path, env={"SANDGATE_MAX_KERNELS": "1"})
    try:
        first = gw.start_kernel()
        r = gw.request("POST", "/api/kernels", {"name": "python3"})
        assert r.status == 403 and r.json() == {"reason": "Forbidden", "code": "limit",
                                                "message": "Maximum number of sandboxes (1) reached"}
        # Sessions count against the same bound (Kernel Gateway's do not).
        r = gw.request("POST", "/api/sessions", {"path": "a.ipynb", "type": "notebook", "kernel": {"name": "python3"}})
        assert r.status == 403
        assert gw.request("GET", f"/api/kernels/{first}").status == 200  # the first one is unharmed
        assert gw.request("DELETE", f"/api/kernels/{first}").status == 204
        assert gw.request("POST", "/api/kernels", {}).status == 201  # room again
    finally:
        gw.stop()


def test_sessions(gateway):
    r = gateway.request("POST", "/api/sessions", {"path": "a.ipynb", "type": "notebook", "name": "a",
                                                  "kernel": {"name": "python3"}})
    assert r.status == 201, r.body
    s = r.json()
    assert s["path"] == "a.ipynb" and s["type"] == "notebook" and s["kernel"]["name"] == "python3"
    assert r.headers["Location"] == f"/api/sessions/{s['id']}"
    assert gateway.request("GET", f"/api/sessions/{s['id']}").json()["kernel"]["id"] == s["kernel"]["id"]
    assert s["id"] in [x["id"] for x in gateway.request("GET", "/api/sessions").json()]
    # The same path again is the same session, not a second kernel.
    again = gateway.request("POST", "/api/sessions", {"path": "a.ipynb", "type": "notebook"}).json()
    assert again["id"] == s["id"]
    r = gateway.request("PATCH", f"/api/sessions/{s['id']}", {"path": "b.ipynb", "name": "b"})
    assert r.status == 200 and r.json()["path"] == "b.ipynb"
    # Attach a second session to the existing kernel by id.
    r = gateway.request("POST", "/api/sessions", {"path": "c.ipynb", "type": "notebook", "kernel": {"id": s["kernel"]["id"]}})
    assert r.status == 201 and r.json()["kernel"]["id"] == s["kernel"]["id"]
    assert gateway.request("DELETE", f"/api/sessions/{s['id']}").status == 204
    assert gateway.request("GET", f"/api/kernels/{s['kernel']['id']}").status == 404
    assert gateway.request("GET", f"/api/sessions/{s['id']}").status == 404
    # Bad input
    r = gateway.request("POST", "/api/sessions", {"type": "notebook"})
    assert r.status == 400 and r.json()["message"] == "Missing field in JSON data: path"
    r = gateway.request("POST", "/api/sessions", {"path": "x.ipynb"})
    assert r.status == 400 and r.json()["message"] == "Missing field in JSON data: type"
    r = gateway.request("POST", "/api/sessions", {"path": "x.ipynb", "type": "notebook", "kernel": {"name": "nope"}})
    assert r.status == 501 and "nope" in r.json()["message"]
    assert gateway.request("DELETE", f"/api/sessions/{UNKNOWN}").status == 404
    assert gateway.request("POST", "/api/sessions", raw=b"{bad").status == 400
