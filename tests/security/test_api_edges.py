"""The smaller hazards at the API's edge: bodies that could give a 500, and file
names that must survive a restore. Real gateway,
real gVisor sandboxes."""

from __future__ import annotations


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


def test_non_utf8_file_names_survive_a_checkpoint_and_fork(gateway):
    sid = gateway.request("POST", "/api/sandboxes", {}).json()["id"]
    try:
        names = "[b'caf\\xe9.txt', b'\\xff\\xfe raw', 'snow \\u2603.txt'.encode()]"
        r = gateway.request("POST", f"/api/sandboxes/{sid}/execute", {"code": (
            f"import os\nfor n in {names}:\n    open(n, 'wb').write(n)\n"
            "print(sorted(os.listdir(b'.')))")})
        before = r.json()["stdout"]
        assert "caf\\xe9" in before, r.body
        fork = gateway.request("POST", f"/api/sandboxes/{sid}/fork", {}).json()["id"]
        try:
            r = gateway.request("POST", f"/api/sandboxes/{fork}/execute", {"code": (
                f"import os\nprint(sorted(os.listdir(b'.')))\nprint(all(open(n, 'rb').read() == n for n in {names}))")})
            assert r.json()["stdout"] == before + "True\n", r.body
        finally:
            gateway.request("DELETE", f"/api/sandboxes/{fork}")
    finally:
        gateway.request("DELETE", f"/api/sandboxes/{sid}")
