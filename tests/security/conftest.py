"""Fixtures the agent's security tests share: a gateway per driver and one
sandbox in it (tests/conftest.py's fixtures apply here too)."""

import pytest


@pytest.fixture(scope="module")
def gw(driver_gw):
    return driver_gw


@pytest.fixture(scope="module")
def sb(gw):
    r = gw.request("POST", "/api/sandboxes", {"driver": gw.driver})
    assert r.status == 201, r.body
    sid = r.json()["id"]
    yield sid
    gw.request("DELETE", f"/api/sandboxes/{sid}")
