"""Issue 29: the gateway holds when its clients and sandboxes are hostile, in bounded memory.
Real gateway, real gVisor sandboxes, real HTTP and websocket clients; the gateway's RSS read
with psutil as test_gateway_bounds.py does."""

from __future__ import annotations

import json
import zlib

import psutil
import pytest

from conftest import Gateway, wait_for

MiB = 1 << 20


def rss(gw: Gateway) -> int:
    return psutil.Process(gw.proc.pid).memory_info().rss


@pytest.fixture(scope="module")
def gw(home, tmp_path_factory):
    g = Gateway(home, tmp_path_factory.mktemp("hostile-memory"))
    yield g
    g.stop()


@pytest.fixture(scope="module")
def e2b_box(gw):
    """An E2B sandbox: (its id, the headers of its envd calls)."""
    r = gw.request("POST", "/e2b/sandboxes", {"templateID": "base"}, token="", headers={"X-API-KEY": gw.token})
    assert r.status == 201, r.body
    box = r.json()
    yield box["sandboxID"], {"E2b-Sandbox-Id": box["sandboxID"], "E2b-Sandbox-Port": "49983",
                             "X-Access-Token": box["envdAccessToken"]}
    gw.request("DELETE", f"/e2b/sandboxes/{box['sandboxID']}", token="", headers={"X-API-KEY": gw.token})


def gzip_of_zeros(n: int) -> bytes:
    """``n`` zero bytes gzipped (about n / 1000), made without holding them."""
    z = zlib.compressobj(6, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    zeros = bytes(MiB)
    return b"".join([*(z.compress(zeros) for _ in range(n // MiB)), z.flush()])


def test_a_gzip_bomb_is_refused_as_it_inflates_not_after(gw, e2b_box):
    """Finding 1: a 1 MB gzip body of zeros took the gateway from 152 MB to 2.2 GB and a 500."""
    sid, headers = e2b_box
    bomb = gzip_of_zeros(512 * MiB)
    assert len(bomb) < MiB
    before = rss(gw)
    r = gw.request("POST", "/e2b/files?path=bomb.bin", token="", raw=bomb,
                   headers={**headers, "Content-Type": "application/octet-stream", "Content-Encoding": "gzip"})
    assert r.status == 413, (r.status, r.body)
    body = r.json()
    assert body["code"] == 413 and "SANDGATE_MAX_MESSAGE_MB" in body["message"], body  # E2B's error shape
    assert rss(gw) - before < 100 * MiB
    # Nothing was written, and the sandbox is fine: a real gzip upload still lands.
    r = gw.request("GET", "/e2b/files?path=bomb.bin", token="", headers=headers)
    assert r.status == 404, r.body
    z = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    small = z.compress(b"inflated fine") + z.flush()
    r = gw.request("POST", "/e2b/files?path=ok.txt", token="", raw=small,
                   headers={**headers, "Content-Type": "application/octet-stream", "Content-Encoding": "gzip"})
    assert r.status == 200, r.body
    assert gw.request("GET", "/e2b/files?path=ok.txt", token="", headers=headers).body == b"inflated fine"
