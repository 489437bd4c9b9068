"""Hostile request bodies at the API's edge get a 400 with what was wrong, never a 500; on the
in-process gateway (the same handlers and models a real one runs)."""


def test_hostile_bodies_get_400_not_500(gateway):
    for ttl in (b"1e308", b"Infinity", b"-Infinity", b"NaN"):
        r = gateway.request("POST", "/api/sandboxes", raw=b'{"ttl": ' + ttl + b"}")
        assert r.status == 400 and "ttl" in r.json()["message"], (ttl, r.body)
    for path in ("/api/sandboxes", "/api/kernels", "/api/sessions"):
        r = gateway.request("POST", path, raw=b"[" * 200_000 + b"]" * 200_000)
        assert r.status == 400 and r.json()["message"] == "Invalid JSON in body of request", (path, r.body)
    r = gateway.request("POST", "/api/sandboxes", raw=b'{"limits": {"cpus": Infinity}}')
    assert r.status == 400 and "cpus" in r.json()["message"], r.body
    assert gateway.request("GET", "/api").status == 200
