"""The Python SDK's typed errors (client/, import name sandgate_client) from the gateway's
answers, on the in-process gateway: the statuses and codes a call and a websocket upgrade map
to, a gateway's limit and a tenant's rate. What a real sandbox does is tests/test_client.py's."""

from __future__ import annotations

import socket

import pytest

from sandgate_client import AuthError, BadRequest, LimitReached, NotFound, RateLimited, Sandbox, Unavailable
from test_client import sb  # noqa: F401 (a fixture, over this module's gw)
from unit.inprocess import InProcessGateway


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    g = InProcessGateway(tmp_path_factory.mktemp("gw"), env={"SANDGATE_MAX_KERNELS": "6"})
    yield g
    g.stop()


def test_typed_errors(gw, sb, tmp_path):
    with pytest.raises(AuthError) as e:
        Sandbox.list(gw.url, "wrong-token")
    assert e.value.status == 401
    with pytest.raises(AuthError):
        Sandbox.create(gw.url, "wrong-token")
    with pytest.raises(NotFound) as e:
        Sandbox.connect("00000000-0000-4000-8000-000000000000", gw.url, gw.token)
    assert e.value.code == "not_found"
    with pytest.raises(BadRequest) as e:
        Sandbox.create(gw.url, gw.token, driver="no-such-driver")
    assert e.value.status == 400 and "no-such-driver" in e.value.message
    with pytest.raises(BadRequest) as e:
        Sandbox.create(gw.url, gw.token, limits={"memory_mb": 10_000_000})
    assert e.value.code == "above_ceiling"
    # Another sandbox's checkpoint id that does not exist.
    with pytest.raises(NotFound):
        sb.fork("no-such-checkpoint")
    # The websocket: the same errors, from the answer to the upgrade.
    from sandgate_client import KernelConnection
    with pytest.raises(AuthError):
        KernelConnection(gw.url, "wrong-token", sb.id)
    with pytest.raises(NotFound):
        KernelConnection(gw.url, gw.token, "00000000-0000-4000-8000-000000000000")
    # Nothing listening: Unavailable, at once.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(Unavailable):
        Sandbox.list(f"http://127.0.0.1:{port}", "t", timeout=5)


def test_limit_reached_and_rate_limited(tmp_path):
    g = InProcessGateway(tmp_path, env={"SANDGATE_MAX_KERNELS": "1", "SANDGATE_TENANT_CREATE_BURST": "1",
                                     "SANDGATE_TENANT_CREATE_RATE": "1"})
    try:
        r = g.request("POST", "/api/tenants", {"name": "acme"})
        assert r.status == 201, r.body
        tenant = r.json()["token"]
        with Sandbox.create(g.url, g.token):
            with pytest.raises(LimitReached) as e:
                Sandbox.create(g.url, g.token)
            assert e.value.status == 403 and e.value.code == "limit" and "Maximum" in e.value.message
            # The tenant's first creation takes its one token (then meets the gateway's limit) ...
            with pytest.raises(LimitReached):
                Sandbox.create(g.url, tenant)
            # ... and the second is over its rate: 429 with when to retry.
            with pytest.raises(RateLimited) as e:
                Sandbox.create(g.url, tenant)
            assert e.value.status == 429 and e.value.code == "rate_limited" and 0 < e.value.retry_after <= 60
            # A tenant's token does not see the admin's sandbox.
            assert Sandbox.list(g.url, tenant) == []
    finally:
        g.stop()
