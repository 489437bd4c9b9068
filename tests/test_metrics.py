"""`GET /metrics` and JSON logs, against a real gateway: the counters move with what happened."""

from __future__ import annotations

import json

from conftest import Gateway


def value(samples, name, **labels):
    return samples.get((name, tuple(sorted(labels.items()))), 0)


def test_metrics_count_starts_executions_checkpoints_and_states(home, tmp_path):
    g = Gateway(home, tmp_path, env={"SANDGATE_WARM_START": "false"}, args=())
    try:
        before = g.metrics()
        sid = g.request("POST", "/api/sandboxes", {}).json()["id"]
        c = g.connect(sid)
        for _ in range(3):
            assert c.execute("1 + 1")["reply"]["status"] == "ok"
        c.close()
        assert g.request("POST", f"/api/sandboxes/{sid}/checkpoints", {}).status == 201
        fork = g.request("POST", f"/api/sandboxes/{sid}/fork", {}).json()["id"]
        after = g.metrics()
        assert value(after, "sandgate_sandboxes", state="running", driver="gvisor") == 2
        assert value(after, "sandgate_sandbox_starts_total", driver="gvisor", path="cold") == \
            value(before, "sandgate_sandbox_starts_total", driver="gvisor", path="cold") + 1
        assert value(after, "sandgate_sandbox_starts_total", driver="gvisor", path="checkpoint") == 1
        assert value(after, "sandgate_execute_seconds_count", driver="gvisor") >= 3
        assert value(after, "sandgate_checkpoints_total", driver="gvisor") == 2  # the fork took one too
        assert value(after, "sandgate_checkpoint_bytes_total", driver="gvisor", kind="state") > 1 << 20
        assert value(after, "sandgate_restore_seconds_count", driver="gvisor") >= 1  # the fork is a restore
        tenant = g.request("POST", "/api/tenants", {"name": "acme"}).json()["token"]
        assert g.request("GET", "/metrics", token=tenant).status == 403
        assert g.request("GET", "/metrics", token="wrong").status == 401
        for s in (sid, fork):
            g.request("DELETE", f"/api/sandboxes/{s}")
        assert value(g.metrics(), "sandgate_sandboxes", state="running", driver="gvisor") == 0
    finally:
        g.stop()


def test_json_logs_carry_the_sandbox_id(home, tmp_path):
    g = Gateway(home, tmp_path, env={"SANDGATE_LOG_FORMAT": "json", "SANDGATE_WARM_START": "false"})
    try:
        sid = g.request("POST", "/api/sandboxes", {}).json()["id"]
        r = g.request("DELETE", f"/api/sandboxes/{sid}", headers={"X-Request-Id": "trace-42"})
        assert r.status == 204 and r.headers["X-Request-Id"] == "trace-42"
        made = g.request("GET", "/api/sandboxes").headers["X-Request-Id"]
        assert len(made) == 16
    finally:
        g.stop()
    lines = [json.loads(line) for line in g.log_text().splitlines() if line.startswith("{")]
    assert lines and all({"time", "level", "logger", "message"} <= set(line) for line in lines)
    mine = [line for line in lines if line.get("sandbox") == sid]
    assert any(line["message"].endswith("starting -> running") for line in mine), mine
    # Lines logged while serving a request carry its id: the client's X-Request-Id, or one made for it.
    assert any(line.get("request") == "trace-42" and "deleted" in line["message"] for line in lines), lines[-5:]
    assert all(line.get("request") for line in lines if line["logger"] == "tornado.access")
