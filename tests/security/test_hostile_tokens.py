"""Unauthenticated hashing amplification. Were every made-up ``sgt.<name>.<x>``
token to cost the gateway one scrypt (~40 ms of CPU), a few hundred requests
would keep both cores busy and hold a real tenant's first request for seconds.
Tenant tokens are 32 random bytes: they are hashed with a keyed HMAC, and a
bogus token costs what any 401 costs. Records hashed with
scrypt still work: checked once, then rewritten with the HMAC.

The real gateway and real sockets, measured relative to a baseline taken in the
same test (a burst of tokens that never looked like a tenant's), so a loaded
machine moves both sides. The key's handling (a fleet, another key) runs in
process on the fake driver."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import secrets
import socket
import sqlite3
import time

import psutil

from conftest import Gateway
from core_harness import make, run
from sandgate.core.record import TenantRecord
from sandgate.core.tenants import Principal, TenantCreate
from sandgate.store.sqlite import SQLiteStore

N = 100  # bogus requests per burst, all in flight at once (each on a connection of its own)
ENV = {"SANDGATE_WARM_START": "false", "SANDGATE_TENANT_CREATE_RATE": "0"}


def cpu(gw: Gateway) -> float:
    t = psutil.Process(gw.proc.pid).cpu_times()
    return t.user + t.system


def raw_request(port: int, token: str) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=120)
    s.sendall(f"GET /api/sandboxes HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: token {token}\r\n"
              f"Connection: close\r\n\r\n".encode())
    return s


def response(s: socket.socket) -> tuple:
    """(status, body) of the one answer on ``s``, read to its close."""
    data = b""
    with s:
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def burst(gw: Gateway, tokens: list, tenant: str) -> dict:
    """``tokens`` all sent at once, then ``tenant``'s request behind them: the gateway's CPU
    time over the lot, how long the tenant's answer took, and every answer."""
    before = cpu(gw)
    flood = [raw_request(gw.port, t) for t in tokens]
    t0 = time.monotonic()
    mine = response(raw_request(gw.port, tenant))
    latency = time.monotonic() - t0
    answers = [response(s) for s in flood]
    # The last answer is out; what the gateway spent on them is counted once it has logged them.
    return {"cpu": cpu(gw) - before, "latency": latency, "tenant": mine, "answers": answers}


def bogus(name: str) -> str:
    return f"sgt.{name}.{secrets.token_urlsafe(32)}"


def test_bogus_tenant_tokens_cost_no_more_than_any_401_and_do_not_hold_a_tenant(home, tmp_path):
    g = Gateway(home, tmp_path, env=ENV)
    try:
        alpha = g.request("POST", "/api/tenants", {"name": "alpha"}).json()["token"]
        beta = g.request("POST", "/api/tenants", {"name": "beta"}).json()["token"]
        # Baseline: tokens that never looked like a tenant's, alpha's first request behind them.
        base = burst(g, [f"not-a-token-{i}" for i in range(N)], alpha)
        # Made-up tenant tokens: unknown names, and wrong secrets for a real tenant; beta's first request behind.
        flood = burst(g, [bogus(f"nosuch{i}") if i % 2 else bogus("alpha") for i in range(N)], beta)
        for run_ in (base, flood):
            assert run_["tenant"][0] == 200, run_["tenant"]
            assert {a for a in run_["answers"]} == {(401, run_["answers"][0][1])}, "every 401 alike"
        # Unknown tenant and wrong secret: one answer, byte for byte.
        assert flood["answers"][0] == flood["answers"][1] == base["answers"][0]
        print(f"CPU: {base['cpu']:.2f} s for {N} plain 401s, {flood['cpu']:.2f} s for {N} bogus tenant tokens; "
              f"a tenant's first request behind them: {base['latency']:.3f} s and {flood['latency']:.3f} s")
        # scrypt was ~40 ms of CPU each: N of them is seconds beside the baseline.
        assert flood["cpu"] <= 2 * base["cpu"] + 0.3, (base["cpu"], flood["cpu"])
        assert flood["latency"] <= 3 * base["latency"] + 0.5, (base["latency"], flood["latency"])
    finally:
        g.stop()


def scrypt_record(name: str) -> tuple:
    """A tenant as gateways before the HMAC stored it, and its token."""
    secret, salt = secrets.token_urlsafe(32), os.urandom(16)
    digest = hashlib.scrypt(secret.encode(), salt=salt, n=1 << 14, r=8, p=1, dklen=32).hex()
    return TenantRecord(name=name, token_hash=digest, salt=salt.hex(), kdf="scrypt-n16384-r8-p1"), \
        f"sgt.{name}.{secret}"


def stored(home) -> dict:
    with sqlite3.connect(home / "sessions.db") as db:
        return {n: json.loads(r) for n, r in db.execute("SELECT name, record FROM tenants")}


def test_a_scrypt_record_is_checked_once_then_rehashed(home, tmp_path):
    own = tmp_path / "old-home"
    own.mkdir()
    (own / "images").symlink_to(home / "images")
    old, token = scrypt_record("legacy")

    async def seed():
        store = SQLiteStore(own / "sessions.db")
        assert await store.create_tenant(old)
        await store.close()

    asyncio.run(seed())
    g = Gateway(home, tmp_path, own_home=own, env=ENV)
    g2 = None
    try:
        assert g.request("GET", "/api/sandboxes", token=bogus("legacy")).status == 401
        assert g.request("GET", "/api/sandboxes", token=token).status == 200
        rec = stored(own)["legacy"]
        assert rec["kdf"] == "hmac-sha256" and rec["token_hash"] != old.token_hash, rec
        assert token.split(".", 2)[2] not in json.dumps(rec)
        assert g.request("GET", "/api/sandboxes", token=token).status == 200  # through the HMAC now
        # From now on a bogus token for it costs no scrypt either.
        base = burst(g, [f"not-a-token-{i}" for i in range(N)], token)
        flood = burst(g, [bogus("legacy") for _ in range(N)], token)
        assert {a[0] for a in flood["answers"]} == {401} and flood["tenant"][0] == 200
        print(f"CPU: {base['cpu']:.2f} s for {N} plain 401s, {flood['cpu']:.2f} s for {N} bogus tokens of a "
              "rehashed tenant")
        assert flood["cpu"] <= 2 * base["cpu"] + 0.3, (base["cpu"], flood["cpu"])
        g.stop()
        g2 = Gateway(home, tmp_path, own_home=own, env=ENV)  # the key is the home's: the token still works
        assert g2.request("GET", "/api/sandboxes", token=token).status == 200
        assert (own / "tenant.key").stat().st_mode & 0o777 == 0o600
    finally:
        g.stop()
        if g2:
            g2.stop()


@run
async def test_the_key_is_what_a_fleet_shares_and_never_in_the_store(tmp_path, caplog):
    """Two nodes on one store: with SANDGATE_TENANT_KEY, or in a fleet with no key
    (derived from the fleet key every node has), each checks the other's
    tokens; two single gateways' own home keys do not, and the log says why."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = make(tmp_path / "a", tenant_key="shared-secret")
    b = make(tmp_path / "b", tenant_key="shared-secret")
    b.manager.store = b.tenants.store = a.manager.store
    made = await a.create_tenant(TenantCreate(name="acme"))
    assert await b.tenants.authenticate(made["token"]) == Principal("acme")
    raw = b"".join(p.read_bytes() for p in (tmp_path / "a").glob("sessions.db*"))
    assert b"shared-secret" not in raw and made["token"].split(".", 2)[2].encode() not in raw
    assert not (tmp_path / "a" / "tenant.key").exists()  # a key given is not written anywhere

    fleet = dict(redis_url="redis://127.0.0.1:1/0", fleet_key="k" * 32)  # the URL's presence is what matters here
    c, d = make(tmp_path / "a", **fleet), make(tmp_path / "b", **fleet)
    d.tenants.store = c.tenants.store
    made = await c.create_tenant(TenantCreate(name="fleet"))
    assert await d.tenants.authenticate(made["token"]) == Principal("fleet")

    e, f = make(tmp_path / "a"), make(tmp_path / "b")  # alone: each home's key
    f.tenants.store = e.tenants.store
    assert (tmp_path / "a" / "tenant.key").read_bytes() != (tmp_path / "b" / "tenant.key").read_bytes()
    made = await e.create_tenant(TenantCreate(name="solo"))
    assert await e.tenants.authenticate(made["token"]) == Principal("solo")
    assert await f.tenants.authenticate(made["token"]) is None
    assert f"hashed with another key (id {e.tenants.key_id}" in caplog.text and "SANDGATE_TENANT_KEY" in caplog.text
