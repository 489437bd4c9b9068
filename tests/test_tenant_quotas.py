"""A tenant's quotas and creation rate set by `sandgate serve`'s flags over their variables, on a
real gateway with runsc sandboxes: 403 over a quota, 429 with Retry-After past the rate."""

from __future__ import annotations

import time

from conftest import Gateway
from unit.test_tenants_gateway import new_tenant


def test_quotas_and_the_creation_rate(home, tmp_path):
    # The rate by flags (over their variables), the memory quota by its variable.
    g = Gateway(home, tmp_path, env={"SANDGATE_WARM_START": "false", "SANDGATE_TENANT_CREATE_RATE": "100",
                                     "SANDGATE_TENANT_MAX_MEMORY_MB": "1536"},
                args=("--tenant-create-rate", "0.01", "--tenant-create-burst", "1"))
    try:
        t = new_tenant(g, "omega", max_sandboxes=1)
        r = t.request("POST", "/api/sandboxes", {"limits": {"memory_mb": 2048}})
        assert r.status == 403 and r.json()["code"] == "limit", r.body
        assert "max_memory_mb of 1536" in r.json()["message"]
        spent = time.monotonic()  # the burst's one token goes here; the bucket refills from then on
        r = t.request("POST", "/api/sandboxes", {"limits": {"memory_mb": 512}})
        assert r.status == 201, r.body
        sid = r.json()["id"]
        r = t.request("POST", "/api/kernels", {})
        assert r.status == 403 and r.json()["message"] == "tenant omega has 1 sandboxes, its quota max_sandboxes is 1"
        assert t.request("DELETE", f"/api/sandboxes/{sid}").status == 204
        r = t.request("POST", "/api/sandboxes", {})  # room again, but its one creation a burst is spent
        assert r.status == 429 and r.json()["code"] == "rate_limited", r.body
        # 0.01 a minute is one every 6000 s, less what has refilled since the token was spent.
        refilled = time.monotonic() - spent
        assert 6000 - refilled - 1 <= int(r.headers["Retry-After"]) <= 6000
        assert "SANDGATE_TENANT_CREATE_RATE" in r.json()["message"]
        assert "Traceback" not in r.body.decode()
    finally:
        g.stop()
