"""A sandbox filling its workspace
fills its own quota, not the host's disk. A cell writing 3 GB into a 256 MB
workspace gets "No space left on device" at 256 MB, the host's free space
barely moves, the sandbox keeps working, and statvfs inside shows the quota,
not the host disk's size.

Driver level (GVisorDriver with a Workspace as the spec's workspace) until the
core creates its workspaces with gateway/workspace.py."""

import asyncio
import json
import os
import subprocess
import uuid

import pytest

from conftest import wait_for
from sandgate.drivers.gvisor import runsc_path
from sandgate.workspace import Workspace, quota_supported, reap_mounts, sandbox_uid
from security.direct import py, sandbox

pytestmark = [
    pytest.mark.skipif(not runsc_path(), reason="runsc is not installed"),
    pytest.mark.skipif(not quota_supported()[0], reason=f"workspace images need root: {quota_supported()[1]}"),
]

QUOTA_MB = 256


FILL = """
import json, os
st = os.statvfs('/workspace')
written, error = 0, None
try:
    with open('/workspace/fill', 'wb') as f:
        chunk = b'\\xa5' * (1 << 20)
        while written < (3 << 30):
            f.write(chunk)
            written += len(chunk)
        f.flush()
        os.fsync(f.fileno())
except OSError as e:
    error = str(e)
print(json.dumps({"written": written, "error": error, "size": st.f_blocks * st.f_frsize,
                  "free": st.f_bavail * st.f_frsize}))
"""

AFTER = """
import json, os
os.remove('/workspace/fill')
open('/workspace/after.txt', 'w').write('still works')
print(json.dumps({"read": open('/workspace/after.txt').read(), "one_plus_one": 1 + 1}))
"""


def loops_under(root) -> list:
    out = subprocess.run(["losetup", "-a"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if str(root.resolve()) in line]


def free_bytes(path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def test_filling_the_workspace_stops_at_its_quota_and_spares_the_host(home, tmp_path):
    root = tmp_path / "workspaces"

    async def scenario():
        ws = Workspace(root, f"sg-quota-{uuid.uuid4().hex[:8]}", QUOTA_MB, sandbox_uid())
        await ws.create()
        try:
            async with sandbox(home, tmp_path, ws) as link:
                host_free = free_bytes(root)
                fill = json.loads(await py(link, FILL, timeout=240))
                host_used = host_free - free_bytes(root)
                image_bytes = os.stat(ws.image).st_blocks * 512
                usage = ws.usage()
                after = json.loads(await py(link, AFTER, timeout=240))
                ping, _ = await link.request("ping")
            return fill, host_used, image_bytes, usage, after, ping
        finally:
            await ws.delete()
            await reap_mounts(root)

    fill, host_used, image_bytes, usage, after, ping = asyncio.run(scenario())
    quota = QUOTA_MB << 20
    # Inside: the quota, not the host's disk, and the write stops there.
    assert fill["size"] == usage["size_bytes"] and 0.9 * quota < fill["size"] <= quota, (fill, usage)
    assert fill["error"] and "No space left" in fill["error"], fill
    assert fill["written"] <= quota, fill
    # The host: at most the image, however much was asked (other tests may
    # write meanwhile, so the bound on the host's free space has slack).
    assert image_bytes <= quota, image_bytes
    assert host_used < quota + (256 << 20), host_used
    # The sandbox carries on.
    assert after == {"read": "still works", "one_plus_one": 2}, after
    assert ping["kernel_alive"] and ping["kernel_responding"], ping
    # Gone without a trace: no mount, no loop device, no file.
    wait_for(lambda: loops_under(root) == [], timeout=30)
    assert os.listdir(root) == []


def test_through_the_api_a_full_workspace_fails_inside_only(gateway):
    """The core gives every gVisor sandbox its own disk of limits.disk_mb."""
    r = gateway.request("POST", "/api/sandboxes", {"limits": {"disk_mb": 64}})
    assert r.status == 201, r.body
    sid = r.json()["id"]
    try:
        host_free = os.statvfs(gateway.home).f_bavail * os.statvfs(gateway.home).f_frsize
        out = gateway.request("POST", f"/api/sandboxes/{sid}/execute", {"timeout": 300, "code": (
            "import os\nst = os.statvfs('/workspace')\nprint(st.f_blocks * st.f_frsize >> 20)\n"
            "try:\n    with open('fill', 'wb') as f:\n        for _ in range(512): f.write(b'x' * (1 << 20))\n"
            "except OSError as e:\n    print('full', e.errno)")}).json()
        size, full = out["stdout"].split("\n")[:2]
        assert int(size) <= 64 and full == "full 28", out  # ENOSPC at the sandbox's own quota
        after = os.statvfs(gateway.home).f_bavail * os.statvfs(gateway.home).f_frsize
        assert host_free - after < 96 << 20  # the host gave at most the quota
        r = gateway.request("PUT", f"/api/sandboxes/{sid}/files/more.bin", raw=b"y" * (4 << 20))
        assert r.status == 403 and "full" in r.json()["message"], r.body  # the files API says so too
        assert gateway.request("POST", f"/api/sandboxes/{sid}/execute",
                               {"code": "import os\nos.remove('fill')\nprint('ok')"}).json()["stdout"] == "ok\n"
        assert gateway.request("PUT", f"/api/sandboxes/{sid}/files/more.bin", raw=b"y" * (4 << 20)).status == 201
    finally:
        gateway.request("DELETE", f"/api/sandboxes/{sid}")
