"""The probes on the in-process gateway: ``/healthz`` (readiness) and ``/livez`` (liveness) answer
without a token and say only that the node is up. Their 503 while a real gateway stops or drains
is tests/test_health.py's."""

from unit.inprocess import InProcessGateway


def test_probes_need_no_token_and_tell_only_liveness(tmp_path):
    g = InProcessGateway(tmp_path, env={"SANDGATE_NODE_ID": "node-h", "SANDGATE_WARM_START": "false"})
    try:
        for token in ("", "not-the-token", None):  # none, a wrong one, the admin's: all the same
            for path in ("/healthz", "/livez"):
                r = g.request("GET", path, token=token)
                assert r.status == 200, (path, token, r.body)
                assert r.json() == {"status": "ok", "node": "node-h"}
                assert r.headers["Content-Type"].startswith("application/json")
                assert r.headers["Cache-Control"] == "no-store"
        assert g.request("GET", "/api", token="").status == 401  # the rest still wants the token
        assert g.request("GET", "/metrics", token="").status == 401
    finally:
        g.stop()
