"""api/admission.py on the in-process gateway, over real HTTP: a body over its bound is refused
from its headers (413), a spent client budget refuses new requests (503, Retry-After) but not the
operator's probes, and a request's body is on the budget exactly while the request runs."""

from __future__ import annotations

import asyncio
import threading

import pytest

from conftest import wait_for
from sandgate.api.admission import Budget
from unit.inprocess import InProcessGateway


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    g = InProcessGateway(tmp_path_factory.mktemp("admission"), env={"SANDGATE_MAX_MESSAGE_MB": "1",
                                                                   "SANDGATE_CLIENT_MEMORY_MB": "16"})
    yield g
    g.stop()


def budget(gw) -> Budget:
    return gw.app.settings["budget"]


def test_budget_counts_what_is_taken_and_given_back():
    b = Budget(100)
    b.take(60)
    assert not b.spent() and b.held == 60
    b.take(40)
    assert b.spent()
    b.give(40)
    assert not b.spent() and b.held == 60


def test_a_body_over_its_bound_is_413_naming_the_setting(gw):
    r = gw.request("POST", "/api/kernels", raw=b"x" * ((1 << 20) + 1))
    assert r.status == 413, r.body
    assert r.json()["code"] == "too_large"
    assert r.json()["message"] == f"the body is {(1 << 20) + 1} bytes; at most 1 MiB (SANDGATE_MAX_MESSAGE_MB) here"
    assert budget(gw).held == 0
    assert gw.request("GET", "/api").status == 200  # the gateway goes on


def test_a_spent_budget_is_503_with_retry_after_but_the_probes_answer(gw):
    b = budget(gw)

    async def spend(n):
        b.take(n)

    busy = lambda s: s.get(("sandgate_busy_refusals_total", ()), 0)  # noqa: E731
    before = busy(gw.metrics())
    gw.call(spend(b.limit))
    try:
        r = gw.request("GET", "/api/kernels")
        assert r.status == 503 and r.headers["Retry-After"] == "1", r.body
        assert r.json()["code"] == "busy" and "SANDGATE_CLIENT_MEMORY_MB=16" in r.json()["message"]
        r = gw.request("POST", "/e2b/sandboxes", {})  # E2B's error shape on its own routes
        assert r.status == 503 and r.json()["code"] == 503 and "retry in a moment" in r.json()["message"]
        for path in ("/healthz", "/livez"):
            assert gw.request("GET", path).status == 200, path
        assert busy(gw.metrics()) == before + 2  # /metrics answers too
    finally:
        gw.call(spend(-b.limit))
    assert gw.request("GET", "/api/kernels").status == 200


def test_a_body_is_held_while_its_request_runs_and_let_go_after(gw):
    sid = gw.create()["id"]
    code = "#block held\n6 * 7" + " " * 200_000  # a body big enough to see on the budget
    answer = {}
    t = threading.Thread(target=lambda: answer.update(
        r=gw.request("POST", f"/api/sandboxes/{sid}/execute", {"code": code})))
    t.start()
    try:
        gw.call(asyncio.wait_for(gw.driver.at_gate["held"].wait(), 30))  # the cell runs: the request is open
        assert budget(gw).held >= len(code)
    finally:
        gw.loop.call_soon_threadsafe(gw.driver.cell_gates["held"].set)
        t.join(60)
    assert not t.is_alive() and answer["r"].status == 200, answer
    outputs = answer["r"].json()["outputs"]
    assert [o["data"]["text/plain"] for o in outputs if o["type"] == "execute_result"] == ["42"], outputs
    wait_for(lambda: budget(gw).held == 0, timeout=10)  # released when the request finished
    gw.request("DELETE", f"/api/sandboxes/{sid}")
