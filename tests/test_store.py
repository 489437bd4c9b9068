"""The session store contract, run against both implementations: the embedded
SQLite file and Redis (a real redis-server on a unix socket of its own).
A fleet of gateways shares the Redis one, so its compare-and-set must hold
under concurrent writers and its records must survive a Redis restart (with
persistence on, as an operator runs it)."""

from __future__ import annotations

import asyncio
import functools
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from sandgate.core.record import NotebookSessionRecord, SandboxRecord, TenantRecord
from sandgate.core.states import State
from sandgate.egress.policy import EgressPolicy
from sandgate.egress.secrets import Secret
from sandgate.store.redis import RedisStore
from sandgate.store.seal import Sealer
from sandgate.store.sqlite import SQLiteStore


class RedisServer:
    """A redis-server of the test's own: unix socket only, append-only file on."""

    def __init__(self, tmp: Path):
        self.dir, self.sock = tmp, tmp / "redis.sock"
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [shutil.which("redis-server") or "redis-server", "--port", "0", "--unixsocket", str(self.sock),
             "--unixsocketperm", "700", "--dir", str(self.dir), "--appendonly", "yes", "--save", ""],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while subprocess.run(["redis-cli", "-s", str(self.sock), "ping"], capture_output=True,
                             text=True).stdout.strip() != "PONG":
            assert self.proc.poll() is None and time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(20)

    @property
    def url(self) -> str:
        return f"unix://{self.sock}"


@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(tmp_path)
    yield server
    server.stop()


@pytest.fixture(params=["sqlite", "redis"])
def make_store(request, tmp_path):
    """A factory: each call is one more gateway process's store on the same data."""
    made = []

    def make(node="n1"):
        if request.param == "sqlite":
            store = SQLiteStore(tmp_path / "sessions.db", node=node)
        else:
            server = getattr(request, "_redis", None) or RedisServer(tmp_path)
            request._redis = server
            store = RedisStore(server.url, node=node, prefix="t:",
                               sealer=Sealer.from_fleet_key("test-fleet-key-0123456789abcdef0123456789abcdef"))
        made.append(store)
        return store

    yield make
    server = getattr(request, "_redis", None)
    if server:
        server.stop()


def run(test):
    @functools.wraps(test)
    def wrapper(*args, **kwargs):
        asyncio.run(asyncio.wait_for(test(*args, **kwargs), 60))
    return wrapper


def record(i="s1", node="n1", **kw) -> SandboxRecord:
    return SandboxRecord(id=i, kernel_name="python3", driver="gvisor", node=node, **kw)


@run
async def test_a_record_round_trips_with_every_field(make_store):
    store = make_store()
    rec = record(labels={}, env={"A": "1"}, egress=EgressPolicy(allow=["api.test:443"]), secrets=[
        Secret(host="api.test", header="Authorization", value="sk-kept-for-the-proxy")], head="c1")
    written = await store.put(rec)
    assert written.version == 1
    back = await store.get("s1")
    assert back.model_dump() == written.model_dump()  # lists stay lists, the policy and the secret's value come back
    assert back.secrets[0].value.get_secret_value() == "sk-kept-for-the-proxy"
    assert (await store.put(back)).version == 2
    assert await store.get("missing") is None
    await store.close()


@run
async def test_compare_and_set_only_from_the_expected_state(make_store):
    store = make_store()
    rec = await store.put(record())
    assert await store.compare_and_set(rec.model_copy(update={"state": State.RUNNING}), State.STARTING)
    assert not await store.compare_and_set(rec.model_copy(update={"state": State.DEAD}), State.STARTING)
    got = await store.get("s1")
    assert got.state == State.RUNNING and got.version == 2
    await store.delete("s1")
    assert not await store.compare_and_set(rec, State.RUNNING)  # gone: nothing to set
    assert await store.get("s1") is None
    await store.close()


@run
async def test_concurrent_writers_one_compare_and_set_wins(make_store):
    stores = [make_store(node=f"n{i}") for i in range(2)]  # two gateway processes
    rec = await stores[0].put(record(state=State.RUNNING))
    moves = [s.compare_and_set(rec.model_copy(update={"state": State.PAUSING, "node": s.node}), State.RUNNING)
             for s in stores for _ in range(10)]
    won = await asyncio.gather(*moves)
    assert sum(won) == 1
    final = await stores[1].get("s1")
    assert final.state == State.PAUSING and final.version == 2
    for s in stores:
        await s.close()


@run
async def test_lists_by_node_follow_a_record_that_moves(make_store):
    store = make_store()
    await store.put(record("a", node="n1"))
    b = await store.put(record("b", node="n1"))
    await store.put(record("c", node="n2"))
    assert sorted(r.id for r in await store.list()) == ["a", "b", "c"]
    assert [r.id for r in await store.list(node="n2")] == ["c"]
    # Taken over by another node (a fleet restores it there): it lists under the new node only.
    assert await store.compare_and_set(b.model_copy(update={"node": "n2"}), State.STARTING)
    assert sorted(r.id for r in await store.list(node="n2")) == ["b", "c"]
    assert [r.id for r in await store.list(node="n1")] == ["a"]
    await store.delete("a")
    assert [r.id for r in await store.list(node="n1")] == []
    await store.close()


@run
async def test_tenants_are_created_once(make_store):
    store = make_store()
    t = TenantRecord(name="acme", token_hash="00", salt="11")
    assert await store.create_tenant(t)
    assert not await store.create_tenant(t.model_copy(update={"token_hash": "ff"}))  # never overwritten
    assert (await store.get_tenant("acme")).token_hash == "00"
    assert [x.name for x in await store.list_tenants()] == ["acme"]
    assert await store.delete_tenant("acme") and not await store.delete_tenant("acme")
    assert await store.get_tenant("acme") is None and await store.list_tenants() == []
    await store.close()


@run
async def test_a_tenant_is_rewritten_only_over_the_hash_read(make_store):
    """A token check rehashing a record (core/tenants.py) must not overwrite a tenant
    that was deleted and re-created, or rehashed by another node, meanwhile."""
    store = make_store()
    old = TenantRecord(name="acme", token_hash="00", salt="11", kdf="scrypt-n16384-r8-p1")
    new = old.model_copy(update={"token_hash": "22", "kdf": "hmac-sha256", "key_id": "k"})
    assert not await store.replace_tenant(new, "00")  # no such tenant: nothing is created
    assert await store.get_tenant("acme") is None
    assert await store.create_tenant(old)
    assert not await store.replace_tenant(new, "ff")
    assert (await store.get_tenant("acme")).token_hash == "00"
    assert await store.replace_tenant(new, "00")
    assert await store.get_tenant("acme") == new and [t.name for t in await store.list_tenants()] == ["acme"]
    assert not await store.replace_tenant(old, "00")  # the hash read is gone: a second rewrite loses
    assert (await store.get_tenant("acme")).token_hash == "22"
    await store.close()


def nb(i, path, owner="acme", kernel="k1") -> NotebookSessionRecord:
    return NotebookSessionRecord(id=i, owner=owner, path=path, kernel_id=kernel)


@run
async def test_notebook_sessions_hold_a_path_per_owner(make_store):
    store, other = make_store(), make_store(node="n2")  # a second gateway on the same data
    assert await store.put_session(nb("a", "x.ipynb"))
    assert await store.put_session(nb("b", "y.ipynb"))
    assert await store.put_session(nb("c", "x.ipynb", owner="globex"))  # paths are per owner
    assert not await other.put_session(nb("d", "x.ipynb"))  # taken: nothing written
    assert await other.get_session("d") is None
    assert not await other.put_session(nb("b", "x.ipynb"))  # moving onto a's path fails too...
    assert (await store.get_session("b")).path == "y.ipynb"  # ...and b keeps its own
    assert await other.put_session(nb("b", "z.ipynb", kernel="k2"))  # a rename frees y.ipynb
    assert (await store.session_by_path("acme", "z.ipynb")).kernel_id == "k2"
    assert await store.session_by_path("acme", "y.ipynb") is None
    assert await store.put_session(nb("d", "y.ipynb"))
    assert sorted(s.id for s in await store.list_sessions("acme")) == ["a", "b", "d"]
    assert [s.id for s in await other.list_sessions("globex")] == ["c"]
    assert len(await store.list_sessions()) == 4
    assert await store.delete_session("a") and not await other.delete_session("a")
    assert await store.get_session("a") is None and await store.session_by_path("acme", "x.ipynb") is None
    assert await other.put_session(nb("e", "x.ipynb"))  # freed by the delete
    for s in (store, other):
        await s.close()


@run
async def test_concurrent_sessions_for_one_path_one_wins(make_store):
    stores = [make_store(node=f"n{i}") for i in range(2)]
    won = await asyncio.gather(*(s.put_session(nb(f"s{j}-{s.node}", "race.ipynb")) for s in stores for j in range(10)))
    assert sum(won) == 1
    assert len(await stores[0].list_sessions("acme")) == 1
    for s in stores:
        await s.close()


@run
async def test_redis_node_liveness_expires(redis_server):
    store = RedisStore(redis_server.url, node="n1", prefix="t:")
    await store.heartbeat("n1", ttl=30, info={"url": "http://127.0.0.1:1"})
    await store.heartbeat("n2", ttl=0.2)
    assert set(await store.live_nodes()) == {"n1", "n2"}
    assert (await store.live_nodes())["n1"] == {"url": "http://127.0.0.1:1"}
    deadline = time.monotonic() + 10
    while "n2" in await store.live_nodes():  # Redis expires the key itself
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    assert set(await store.live_nodes()) == {"n1"}
    await store.close()


@run
async def test_redis_records_survive_a_redis_restart(redis_server):
    store = RedisStore(redis_server.url, node="n1", prefix="t:")
    await store.put(record(state=State.PAUSED))
    redis_server.stop()
    with pytest.raises(Exception):
        await store.get("s1")  # down: an error, not a hang or a wrong answer
    redis_server.start()
    back = await store.get("s1")  # the same client reconnects
    assert back is not None and back.state == State.PAUSED and back.version == 1
    await store.close()
