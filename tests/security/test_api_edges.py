"""File names that are not UTF-8 survive a checkpoint and a fork of a real gVisor sandbox
(hostile bodies at the API's edge are tests/unit/test_api_edges.py's)."""

from __future__ import annotations


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
