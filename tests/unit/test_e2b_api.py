"""The E2B-compatible API's auth, scoping, refusals and bad input, driven by the unmodified `e2b`
and `e2b-code-interpreter` SDKs against the in-process gateway; the service method the adapter
added, on the fake driver. What the SDKs do with a real kernel is tests/test_e2b.py's."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest

import e2b  # the test extra installs both SDKs: a missing one fails the module, it is never skipped
from e2b_code_interpreter import Sandbox

from core_harness import make, run
from sandgate.api.e2b import e2b_api_key
from test_e2b import sb, sdk_pointed_at  # noqa: F401 (sb: a fixture, over this module's gw)
from unit.inprocess import InProcessGateway


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    g = InProcessGateway(tmp_path_factory.mktemp("e2b"), env={"SANDGATE_TENANT_CREATE_RATE": "0"})
    with sdk_pointed_at(g):
        yield g
    g.stop()


def raw(gw, method, path, body=None, headers=None):
    """A request the SDK would not make: status and parsed JSON (or text)."""
    data = json.dumps(body).encode() if isinstance(body, (dict, list)) else body
    req = urllib.request.Request(gw.url + path, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            status, text = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read()
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def test_bad_key_and_unknown_sandbox(gw):
    with pytest.raises(e2b.AuthenticationException):
        Sandbox.create(api_key=e2b_api_key("not-a-sandgate-token"))
    with pytest.raises(e2b.AuthenticationException):
        Sandbox.list(api_key=e2b_api_key("not-a-sandgate-token")).next_items()
    with pytest.raises(e2b.SandboxNotFoundException):
        Sandbox.connect("no-such-sandbox")
    with pytest.raises(e2b.SandboxNotFoundException):
        Sandbox.get_info("no-such-sandbox")
    with pytest.raises(e2b.SandboxNotFoundException):
        Sandbox.set_timeout("no-such-sandbox", 60)


def test_sandbox_calls_need_the_sandbox_token(gw, sb):
    h = {"E2b-Sandbox-Id": sb.sandbox_id, "E2b-Sandbox-Port": "49983"}
    assert raw(gw, "GET", "/e2b/health", headers={**h, "X-Access-Token": sb._envd_access_token})[0] == 204
    status, body = raw(gw, "GET", "/e2b/health", headers={**h, "X-Access-Token": "forged"})
    assert status == 401 and body["code"] == 401
    # another sandbox's token does not open this one
    other = Sandbox.create()
    try:
        assert raw(gw, "GET", "/e2b/health", headers={**h, "X-Access-Token": other._envd_access_token})[0] == 401
    finally:
        other.kill()
    # the code interpreter's port is not envd's
    status, body = raw(gw, "GET", "/e2b/health", headers={**h, "E2b-Sandbox-Port": "49999",
                                                           "X-Access-Token": sb._envd_access_token})
    assert status == 404 and "not served on port 49999" in body["message"]


def test_unsupported_calls_and_bad_input(gw, sb):
    with pytest.raises(e2b.SandboxException, match="process.Process/Start is not supported"):
        sb.commands.run("ls")
    key = {"X-API-KEY": gw.token}
    status, body = raw(gw, "GET", "/e2b/templates", headers=key)
    assert status == 501 and body["code"] == 501 and "not supported" in body["message"]
    status, body = raw(gw, "POST", "/e2b/sandboxes", b"{not json", headers=key)
    assert status == 400 and body["code"] == 400
    # unknown fields are ignored, as E2B ignores them; the v1 path creates too
    status, body = raw(gw, "POST", "/e2b/sandboxes", {"templateID": "base", "timeout": 60, "frobnicate": True,
                                                      "metadata": {"k": "v"}}, headers=key)
    assert status == 201, body
    assert body["templateID"] == "base" and body["clientID"] and body["envdVersion"] >= "0.4.0"
    sid = body["sandboxID"]
    status, body = raw(gw, "GET", f"/e2b/sandboxes/{sid}", headers=key)
    assert status == 200 and body["metadata"] == {"k": "v"} and body["state"] == "running"
    assert raw(gw, "DELETE", f"/e2b/sandboxes/{sid}", headers=key)[0] == 204
    status, body = raw(gw, "POST", "/e2b/sandboxes", {"templateID": "no-such-template"}, headers=key)
    assert status == 404 and "no-such-template" in body["message"]
    status, body = raw(gw, "POST", "/e2b/sandboxes", {"envVars": {"SECRET": "x"}}, headers=key)
    assert status == 400 and "SANDGATE_ENV_ALLOW" in body["message"]
    status, body = raw(gw, "POST", f"/e2b/sandboxes/{sb.sandbox_id}/timeout", {"timeout": "soon"}, headers=key)
    assert status == 400 and body["code"] == 400


def test_tenant_tokens_scope_what_the_sdk_sees(gw):
    tokens = {}
    for name in ("e2b-alpha", "e2b-beta"):
        r = gw.request("POST", "/api/tenants", {"name": name})
        assert r.status == 201, r.body
        tokens[name] = r.json()["token"]
    a = Sandbox.create(api_key=e2b_api_key(tokens["e2b-alpha"]))
    try:
        assert a.run_code("'alpha'").text == "'alpha'"  # the sandbox's own token carries the tenant
        assert [s.sandbox_id for s in Sandbox.list(api_key=e2b_api_key(tokens["e2b-alpha"])).next_items()] == [a.sandbox_id]
        assert Sandbox.list(api_key=e2b_api_key(tokens["e2b-beta"])).next_items() == []
        with pytest.raises(e2b.SandboxNotFoundException):
            Sandbox.connect(a.sandbox_id, api_key=e2b_api_key(tokens["e2b-beta"]))
        assert Sandbox.kill(a.sandbox_id, api_key=e2b_api_key(tokens["e2b-beta"])) is False
        assert a.sandbox_id in [s.sandbox_id for s in Sandbox.list().next_items()]  # the admin sees all
        r = gw.request("GET", f"/api/sandboxes/{a.sandbox_id}")
        assert r.json()["owner"] == "e2b-alpha"
    finally:
        assert Sandbox.kill(a.sandbox_id, api_key=e2b_api_key(tokens["e2b-alpha"])) is True


@run
async def test_set_timeout_in_the_service(tmp_path):
    from sandgate.core.errors import BadRequest, CeilingExceeded, NotFound
    from sandgate.core.service import StartRequest
    from sandgate.core.tenants import Principal, TenantCreate

    svc = make(tmp_path, max_ttl=1000)
    sb = await svc.start(StartRequest(ttl=100))
    before = sb.record.expires
    await svc.set_timeout(sb.id, 600)
    assert sb.record.expires > before and abs(sb.record.expires - (time.time() + 600)) < 5
    assert (await svc.manager.store.get(sb.id)).expires == sb.record.expires  # kept: a restart keeps it
    with pytest.raises(CeilingExceeded, match="SANDGATE_MAX_TTL"):
        await svc.set_timeout(sb.id, 5000)
    with pytest.raises(BadRequest):
        await svc.set_timeout(sb.id, 0)
    await svc.create_tenant(TenantCreate(name="other"))
    with pytest.raises(NotFound):
        await svc.set_timeout(sb.id, 60, Principal("other"))
    await svc.delete(sb.id)
