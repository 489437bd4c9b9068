"""Tenants on the fake driver, in seconds: scoping in the service (another
tenant's ids are NotFound, lists leave them out, the admin sees all), quotas,
the creation rate limit with an injected clock, tokens stored hashed, tenants
kept across a restart, per-tenant checkpoint deduplication; then the same
through the real HTTP handlers and websocket (in-process tornado on the fake
driver): 404s everywhere, 429 with Retry-After, 400s naming the field.
test_tenants_gateway.py runs the essentials over HTTP on the in-process gateway;
tests/test_tenant_quotas.py the quotas set by flags on a real `sandgate serve`."""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest
from tornado.httpclient import AsyncHTTPClient, HTTPRequest
from tornado.httpserver import HTTPServer
from tornado.netutil import bind_sockets
from tornado.websocket import websocket_connect

from core_harness import Client, make, run
from sandgate.app import make_app
from sandgate.core.errors import Forbidden, LimitReached, NotFound, RateLimited
from sandgate.core.service import StartRequest
from sandgate.core.states import State
from sandgate.core.tenants import ADMIN, Principal, TenantCreate


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def tenant(svc, name, **quotas):
    made = await svc.create_tenant(TenantCreate(name=name, **quotas))
    who = await svc.tenants.authenticate(made["token"])
    assert who == Principal(name)
    return who, made["token"]


async def start(svc, who, **kw):
    return await svc.start(StartRequest(**kw), who)


@run
async def test_a_tenant_reaches_only_its_own_and_the_admin_everything(tmp_path):
    svc = make(tmp_path)
    a, _ = await tenant(svc, "alpha")
    b, _ = await tenant(svc, "beta")
    sa, sb = await start(svc, a), await start(svc, b)
    mine = await start(svc, ADMIN)
    assert (sa.record.owner, sb.record.owner, mine.record.owner) == ("alpha", "beta", "")
    await svc.write_file(sa.id, "secret.txt", b"alpha's", a)
    cp = await svc.checkpoint(sa.id, "c", a)
    assert cp.owner == "alpha"

    assert [s.id for s in svc.list(a)] == [sa.id]
    assert [s.id for s in svc.list(b)] == [sb.id]
    assert {s.id for s in svc.list(ADMIN)} == {sa.id, sb.id, mine.id}
    assert svc.list(Principal("nobody")) == []
    # Every way in, for beta, to alpha's sandbox: NotFound, the message an unknown id gets.
    unknown = str(uuid.uuid4())
    calls = {
        "get": lambda sid: svc.get(sid, b),
        "checkpoints": lambda sid: svc.checkpoints(sid, b),
        "delete": lambda sid: svc.delete(sid, b),
        "checkpoint": lambda sid: svc.checkpoint(sid, "x", b),
        "pause": lambda sid: svc.pause(sid, "disk", b),
        "resume": lambda sid: svc.resume(sid, b),
        "restart": lambda sid: svc.restart(sid, b),
        "interrupt": lambda sid: svc.interrupt(sid, b),
        "execute": lambda sid: svc.execute(sid, "1", 5, who=b),
        "fork": lambda sid: svc.fork(sid, None, b),
        "list_files": lambda sid: svc.list_files(sid, "", b),
        "read_file": lambda sid: svc.read_file(sid, "secret.txt", b),
        "write_file": lambda sid: svc.write_file(sid, "x", b"y", b),
        "delete_file": lambda sid: svc.delete_file(sid, "secret.txt", b),
    }
    for what, call in calls.items():
        for sid in (sa.id, mine.id, unknown):
            with pytest.raises(NotFound) as e:
                r = call(sid)
                if asyncio.iscoroutine(r):
                    await r
            assert str(e.value) == f"Sandbox does not exist: {sid}", what
    # Alpha's checkpoint: not beta's to see, start from or fork through.
    with pytest.raises(NotFound, match=f"No such checkpoint: {cp.id}"):
        svc.checkpoint_get(cp.id, b)
    with pytest.raises(NotFound, match=f"No such checkpoint: {cp.id}"):
        await start(svc, b, checkpoint=cp.id)
    with pytest.raises(NotFound, match=f"No such checkpoint: {cp.id}"):
        await svc.fork(sb.id, cp.id, b)
    tree_b = svc.tree(b)["nodes"]
    assert {n["id"] for n in tree_b} == {sb.id}
    assert {n["id"] for n in svc.tree(a)["nodes"]} == {sa.id, cp.id}
    assert {n["id"] for n in svc.tree(ADMIN)["nodes"]} >= {sa.id, sb.id, mine.id, cp.id}
    # Nothing of alpha's changed; alpha itself and the admin reach it.
    assert sa.state == State.RUNNING and await svc.read_file(sa.id, "secret.txt", a) == b"alpha's"
    assert await svc.read_file(sa.id, "secret.txt", ADMIN) == b"alpha's"
    # Its own checkpoint: alpha starts and forks from it; the copies are alpha's.
    copy = await start(svc, a, checkpoint=cp.id)
    fork = await svc.fork(sa.id, cp.id, a)
    assert copy.record.owner == fork.record.owner == "alpha"
    assert await svc.read_file(copy.id, "secret.txt", a) == b"alpha's"
    # A websocket-like client of alpha's kernel works as before.
    c = Client(sa)
    got = await c.replies([c.execute("6 * 7")])
    assert list(got.values())[0]["outputs"] == ["42"]


@run
async def test_checkpoint_dedup_stays_inside_a_tenant(tmp_path):
    svc = make(tmp_path)
    a, _ = await tenant(svc, "alpha")
    b, _ = await tenant(svc, "beta")
    data = b"the same model weights" * 5000
    sa, sb = await start(svc, a), await start(svc, b)
    await svc.write_file(sa.id, "w.bin", data, a)
    assert (await svc.checkpoint(sa.id, "", a)).new_bytes == len(data)
    assert (await svc.checkpoint(sa.id, "", a)).new_bytes == 0  # within alpha: stored once
    await svc.write_file(sb.id, "w.bin", data, b)
    assert (await svc.checkpoint(sb.id, "", b)).new_bytes == len(data)  # beta cannot tell alpha has it


@run
async def test_quotas_name_themselves_and_count_starts_in_flight(tmp_path):
    svc = make(tmp_path, tenant_max_sandboxes=3, tenant_max_memory_mb=2048, tenant_create_rate=0)
    a, _ = await tenant(svc, "alpha", max_sandboxes=2)
    b, _ = await tenant(svc, "beta")  # the gateway's defaults: 3 sandboxes, 2048 MB
    # Two at once, the quota exactly: both start; a third at the same time is refused.
    got = await asyncio.gather(*(start(svc, a) for _ in range(3)), return_exceptions=True)
    refused = [g for g in got if isinstance(g, Exception)]
    assert len(refused) == 1 and isinstance(refused[0], LimitReached)
    assert str(refused[0]) == "tenant alpha has 2 sandboxes, its quota max_sandboxes is 2"
    assert refused[0].status == 403 and refused[0].code == "limit"
    assert len(svc.list(a)) == 2
    # Deleting one frees its place.
    await svc.delete(svc.list(a)[0].id, a)
    await start(svc, a)
    # Memory: the sum of limits.memory_mb (default 1024 each).
    await start(svc, b)
    await start(svc, b)
    with pytest.raises(LimitReached, match=r"would use 3072 MB of memory \(2048 MB now \+ 1024 MB\), above its "
                                           r"quota max_memory_mb of 2048"):
        await start(svc, b)
    # The admin has no tenant quota; beta's quotas are not alpha's.
    await start(svc, ADMIN)
    assert (await svc.tenant_model(await svc.tenants.get("beta")))["memory_mb"] == 2048
    assert [(t["name"], t["max_sandboxes"], t["sandboxes"]) for t in await svc.list_tenants()] == [
        ("alpha", 2, 2), ("beta", 3, 2)]


@run
async def test_creation_rate_is_a_token_bucket_per_tenant(tmp_path):
    svc = make(tmp_path, tenant_create_rate=6, tenant_create_burst=2)  # one every 10 s after 2 at once
    clock = Clock()
    svc.tenants.clock = clock
    a, _ = await tenant(svc, "alpha")
    b, _ = await tenant(svc, "beta")
    s1 = await start(svc, a)
    await start(svc, a)
    with pytest.raises(RateLimited) as e:
        await start(svc, a)
    assert e.value.status == 429 and e.value.code == "rate_limited"
    assert e.value.retry_after == pytest.approx(10)
    assert "at most 6 a minute, 2 at once (SANDGATE_TENANT_CREATE_RATE)" in str(e.value)
    with pytest.raises(RateLimited):
        await svc.fork(s1.id, None, a)  # a fork is a creation too; refused before any checkpoint
    assert svc.manager.checkpoints.list(sandbox=s1.id) == []
    await start(svc, b)  # beta has its own bucket
    await start(svc, ADMIN)  # the admin has none
    clock.now += 4
    with pytest.raises(RateLimited) as e:
        await start(svc, a)
    assert e.value.retry_after == pytest.approx(6)
    clock.now += 6
    await start(svc, a)
    assert len(svc.list(a)) == 3


@run
async def test_tokens_are_stored_hashed_and_tenants_survive_a_restart(tmp_path):
    svc = make(tmp_path)
    a, token = await tenant(svc, "alpha", max_memory_mb=4096)
    assert token.startswith("sgt.alpha.")
    secret = token.split(".", 2)[2]
    raw = (tmp_path / "sessions.db").read_bytes() + b"".join(
        p.read_bytes() for p in tmp_path.glob("sessions.db-*"))
    assert secret.encode() not in raw and token.encode() not in raw
    rec = await svc.manager.store.get_tenant("alpha")
    assert rec.token_hash and rec.salt and secret not in rec.model_dump_json()
    assert await svc.tenants.authenticate(token[:-1] + ("A" if token[-1] != "A" else "B")) is None
    assert await svc.tenants.authenticate("sgt.nobody." + secret) is None
    assert await svc.tenants.authenticate("test-token") is None
    sb = await start(svc, a)
    await svc.manager.store.close()

    svc2 = make(tmp_path)  # the next gateway on the same home
    assert await svc2.tenants.authenticate(token) == Principal("alpha")
    assert [t["name"] for t in await svc2.list_tenants()] == ["alpha"]
    assert (await svc2.get_tenant("alpha"))["max_memory_mb"] == 4096
    await svc2.manager.recover()
    assert [s.id for s in svc2.list(Principal("alpha"))] == [sb.id]
    assert svc2.list(Principal("beta")) == []


@run
async def test_tenants_are_the_admins_and_deleting_one_deletes_its_sandboxes(tmp_path):
    svc = make(tmp_path)
    a, token = await tenant(svc, "alpha")
    b, _ = await tenant(svc, "beta")
    for call in (svc.create_tenant(TenantCreate(name="gamma"), a), svc.list_tenants(a), svc.get_tenant("alpha", a),
                 svc.delete_tenant("beta", a)):
        with pytest.raises(Forbidden, match="only the admin"):
            await call
    with pytest.raises(Exception) as e:
        await svc.create_tenant(TenantCreate(name="alpha"))
    assert e.value.status == 409 and "exists" in str(e.value)
    s1, s2, other = await start(svc, a), await start(svc, a), await start(svc, b)
    await svc.checkpoint(s1.id, "", a)
    gone = await svc.delete_tenant("alpha")
    assert sorted(gone["sandboxes_deleted"]) == sorted([s1.id, s2.id])
    assert [s.id for s in svc.list()] == [other.id]
    assert svc.manager.checkpoints.list(owner="alpha") == []
    assert await svc.tenants.authenticate(token) is None  # its token is dead at once
    with pytest.raises(NotFound):
        await svc.delete_tenant("alpha")
    again = await svc.create_tenant(TenantCreate(name="alpha"))  # a new alpha: a new token, nothing of the old
    assert again["token"] != token and again["sandboxes"] == 0
    assert await svc.tenants.authenticate(token) is None


# -- through HTTP, in-process ------------------------------------------------------------
ADMIN_TOKEN = "admin-token"


class Http:
    def __init__(self, port):
        self.port = port
        self.client = AsyncHTTPClient()

    async def __call__(self, method, path, body=None, token=ADMIN_TOKEN, raw=None):
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        if data is None and method in ("POST", "PUT", "PATCH"):
            data = b"{}"
        headers = {"Authorization": f"token {token}"} if token else {}
        r = await self.client.fetch(HTTPRequest(f"http://127.0.0.1:{self.port}{path}", method=method, body=data,
                                                headers=headers, allow_nonstandard_methods=True), raise_error=False)
        try:
            r.data = json.loads(r.body) if r.body else None
        except ValueError:
            r.data = r.body
        return r


async def serve(tmp_path, **settings):
    svc = make(tmp_path, token=ADMIN_TOKEN, **settings)
    server = HTTPServer(make_app(svc.settings, svc))
    socks = bind_sockets(0, "127.0.0.1")
    server.add_sockets(socks)
    return svc, server, Http(socks[0].getsockname()[1])


@run
async def test_http_every_route_is_404_for_another_tenants_ids(tmp_path):
    svc, server, http = await serve(tmp_path, tenant_create_rate=0)
    try:
        ta = (await http("POST", "/api/tenants", {"name": "alpha"})).data["token"]
        made = await http("POST", "/api/tenants", {"name": "beta"})
        assert made.code == 201 and made.headers["Cache-Control"] == "no-store"
        tb = made.data["token"]
        k = (await http("POST", "/api/kernels", {}, token=ta)).data["id"]
        s = (await http("POST", "/api/sandboxes", {}, token=ta)).data
        assert s["owner"] == "alpha"
        assert (await http("PUT", f"/api/sandboxes/{s['id']}/files/f.txt", raw=b"hi", token=ta)).code == 201
        cp = (await http("POST", f"/api/sandboxes/{s['id']}/checkpoints", {}, token=ta)).data
        sess = (await http("POST", "/api/sessions", {"path": "a.ipynb", "type": "notebook", "kernel": {"id": k}},
                           token=ta)).data
        routes = [("GET", f"/api/kernels/{k}"), ("DELETE", f"/api/kernels/{k}"), ("POST", f"/api/kernels/{k}/restart"),
                  ("POST", f"/api/kernels/{k}/interrupt"), ("GET", f"/api/sandboxes/{s['id']}"),
                  ("DELETE", f"/api/sandboxes/{s['id']}"), ("POST", f"/api/sandboxes/{s['id']}/execute"),
                  ("POST", f"/api/sandboxes/{s['id']}/pause"), ("POST", f"/api/sandboxes/{s['id']}/resume"),
                  ("GET", f"/api/sandboxes/{s['id']}/checkpoints"), ("POST", f"/api/sandboxes/{s['id']}/checkpoints"),
                  ("POST", f"/api/sandboxes/{s['id']}/fork"), ("GET", f"/api/sandboxes/{s['id']}/files/f.txt"),
                  ("GET", f"/api/sandboxes/{s['id']}/files/"), ("PUT", f"/api/sandboxes/{s['id']}/files/g"),
                  ("DELETE", f"/api/sandboxes/{s['id']}/files/f.txt"), ("GET", f"/api/sessions/{sess['id']}"),
                  ("PATCH", f"/api/sessions/{sess['id']}"), ("DELETE", f"/api/sessions/{sess['id']}")]
        bodies = {f"/api/sandboxes/{s['id']}/execute": {"code": "1"}}
        for method, path in routes:
            r = await http(method, path, bodies.get(path), token=tb)
            assert r.code == 404, (method, path, r.code, r.body)
            assert "alpha" not in r.body.decode()
        r = await http("POST", "/api/sandboxes", {"checkpoint": cp["id"]}, token=tb)
        assert r.code == 404 and r.data["message"] == f"No such checkpoint: {cp['id']}"
        r = await http("POST", "/api/sessions", {"path": "b.ipynb", "type": "notebook", "kernel": {"id": k}}, token=tb)
        assert r.code == 404
        # Same path as alpha's session: beta gets a session of its own, not alpha's.
        r = await http("POST", "/api/sessions", {"path": "a.ipynb", "type": "notebook"}, token=tb)
        assert r.code == 201 and r.data["id"] != sess["id"] and r.data["kernel"]["id"] != k
        kb = r.data["kernel"]["id"]
        # Lists: each its own; the admin all.
        assert [x["id"] for x in (await http("GET", "/api/kernels", token=tb)).data] == [kb]
        assert [x["id"] for x in (await http("GET", "/api/sandboxes", token=tb)).data] == [kb]
        assert [x["id"] for x in (await http("GET", "/api/sessions", token=tb)).data] == [r.data["id"]]
        assert {x["id"] for x in (await http("GET", "/api/kernels", token=ta)).data} == {k, s["id"]}
        assert {x["id"] for x in (await http("GET", "/api/kernels")).data} == {k, s["id"], kb}
        assert len((await http("GET", "/api/sessions")).data) == 2
        tree = (await http("GET", "/api/sandboxes/tree", token=tb)).data["nodes"]
        assert [n["id"] for n in tree] == [kb]
        # Websockets: 404 before the upgrade for beta; alpha's connects.
        url = f"ws://127.0.0.1:{http.port}/api/kernels/{k}/channels"
        with pytest.raises(Exception) as e:
            await websocket_connect(HTTPRequest(url, headers={"Authorization": f"token {tb}"}))
        assert getattr(e.value, "code", None) == 404
        ws = await websocket_connect(HTTPRequest(url, headers={"Authorization": f"token {ta}"}))
        ws.close()
        # Alpha's things are untouched; the admin reaches them.
        assert (await http("GET", f"/api/sandboxes/{s['id']}/files/f.txt", token=ta)).body == b"hi"
        assert (await http("GET", f"/api/sandboxes/{s['id']}/files/f.txt")).body == b"hi"
        assert (await http("GET", f"/api/sessions/{sess['id']}", token=ta)).code == 200
    finally:
        server.stop()


@run
async def test_http_tenant_admin_errors_and_429(tmp_path):
    svc, server, http = await serve(tmp_path, tenant_create_rate=0.6, tenant_create_burst=1)  # one per 100 s
    try:
        for body, field in (({"name": "Bad Name"}, "name"), ({"name": ""}, "name"), ({}, "name"),
                            ({"name": "x" * 64}, "name"), ({"name": "ok", "max_sandboxes": -1}, "max_sandboxes"),
                            ({"name": "ok", "max_memory_mb": "lots"}, "max_memory_mb"),
                            ({"name": "ok", "token": "mine"}, "token"), ({"name": 5}, "name"),
                            ({"name": "ok", "max_sandboxes": 1e308}, "max_sandboxes"),
                            ({"name": "ok", "max_memory_mb": 1.5}, "max_memory_mb"),
                            ({"name": "ok\u0000"}, "name"), ({"name": "a.b"}, "name")):
            r = await http("POST", "/api/tenants", body)
            assert r.code == 400 and r.data["message"].startswith(f"{field}:"), (body, r.body)
        for raw in (b"{bad", b"[" * 200_000 + b"]" * 200_000, b'{"name": "ok", "max_sandboxes": Infinity}'):
            r = await http("POST", "/api/tenants", raw=raw)
            assert r.code == 400 and ("Invalid JSON" in r.data["message"] or "max_sandboxes" in r.data["message"])
        assert (await http("GET", "/api/tenants")).data == []  # nothing was made of any of it
        t = (await http("POST", "/api/tenants", {"name": "alpha", "max_sandboxes": 5})).data
        assert set(t) == {"name", "token", "max_sandboxes", "max_memory_mb", "max_checkpoint_mb", "created", "sandboxes",
                          "memory_mb", "checkpoint_bytes"}
        assert (await http("POST", "/api/tenants", {"name": "alpha"})).code == 409
        listed = (await http("GET", "/api/tenants")).data
        assert [x["name"] for x in listed] == ["alpha"] and "token" not in listed[0]
        assert "token" not in (await http("GET", "/api/tenants/alpha")).data
        for method, path in (("GET", "/api/tenants"), ("POST", "/api/tenants"), ("GET", "/api/tenants/alpha"),
                             ("DELETE", "/api/tenants/alpha")):
            r = await http(method, path, {"name": "zeta"} if method == "POST" else None, token=t["token"])
            assert r.code == 403 and r.data["code"] == "forbidden", (method, path)
        assert (await http("GET", "/api/tenants", token="sgt.alpha.wrong")).code == 401
        assert (await http("GET", "/api/tenants/nope")).code == 404
        doc = (await http("GET", "/api/sandboxes/openapi.json")).data
        assert {"/api/tenants", "/api/tenants/{name}"} <= set(doc["paths"])
        assert doc["components"]["schemas"]["TenantCreate"]["properties"]["name"]["pattern"]
        assert (await http("POST", "/api/sandboxes", {}, token=t["token"])).code == 201
        r = await http("POST", "/api/kernels", {}, token=t["token"])
        assert r.code == 429 and r.data["code"] == "rate_limited"
        assert r.headers["Retry-After"] == "100" and r.data["retry_after"] == pytest.approx(100, abs=1)
        r = await http("POST", "/api/sandboxes", {"limits": {"memory_mb": "x"}}, token=t["token"])
        assert r.code == 400 and "limits.memory_mb" in r.data["message"]  # bad input before the rate limit
        assert (await http("POST", "/api/sandboxes", {})).code == 201  # the admin is not limited
        r = await http("DELETE", "/api/tenants/alpha")
        assert r.code == 200 and len(r.data["sandboxes_deleted"]) == 1
        assert (await http("GET", "/api/sandboxes", token=t["token"])).code == 401
        assert len((await http("GET", "/api/sandboxes")).data) == 1
    finally:
        server.stop()


@run
async def test_a_start_in_flight_when_its_tenant_is_deleted_is_deleted_too(tmp_path):
    from core_harness import driver_of

    svc = make(tmp_path)
    a, _ = await tenant(svc, "alpha")
    drv = driver_of(svc)
    drv.gates["create"] = asyncio.Event()
    starting = asyncio.ensure_future(start(svc, a))
    await drv.entered["create"].wait()
    assert svc.usage("alpha") == (1, 1024)  # counted while it starts
    deleting = asyncio.ensure_future(svc.delete_tenant("alpha"))
    while await svc.manager.store.get_tenant("alpha") is not None:  # the record goes first...
        await asyncio.sleep(0)
    assert not deleting.done()  # ...while its sandbox's delete waits for the start's lifecycle lock
    drv.gates["create"].set()  # the delete waited for the start's lifecycle lock; now both finish
    with pytest.raises(NotFound, match="No such tenant: alpha"):
        await starting
    gone = await deleting
    assert svc.list() == [] and svc.usage("alpha") == (0, 0)
    assert gone["name"] == "alpha" and len(gone["sandboxes_deleted"]) == 1
