"""A sandbox must not hand a host user the uid of a real
account. A cell copies /usr/bin/id into /workspace and makes it setuid and
setgid; on the host that file belongs to a uid no account or group has, sits
behind a 0700 root directory, on a nosuid mount: run by `nobody` it gives
nobody anything.

Driver level (GVisorDriver with a Workspace as the spec's workspace) until the
core creates its workspaces with gateway/workspace.py."""

import asyncio
import grp
import json
import os
import pwd
import shutil
import stat
import subprocess
import tempfile
import uuid
from pathlib import Path

import pytest

from sandgate.drivers.gvisor import runsc_path
from sandgate.workspace import Workspace, quota_supported, reap_mounts, sandbox_uid
from security.direct import py, sandbox

pytestmark = [
    pytest.mark.skipif(not runsc_path(), reason="runsc is not installed"),
    pytest.mark.skipif(not quota_supported()[0], reason=f"workspace images need root: {quota_supported()[1]}"),
]


SETUID_CELL = """
import json, os, shutil
shutil.copy('/usr/bin/id', '/workspace/id')
os.chmod('/workspace/id', 0o6755)
st = os.stat('/workspace/id')
print(json.dumps({"uid": os.getuid(), "gid": os.getgid(), "user": os.environ.get("USER"),
                  "home": os.path.expanduser("~"), "file_uid": st.st_uid, "mode": st.st_mode}))
"""


def as_nobody(path) -> subprocess.CompletedProcess:
    return subprocess.run(["runuser", "-u", "nobody", "--", str(path)], capture_output=True, text=True, timeout=30)


@pytest.fixture
def base():
    """A directory `nobody` could reach if it were opened (pytest's are under a 0700 one)."""
    path = Path(tempfile.mkdtemp(prefix="sandgate-uid-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_setuid_file_from_a_sandbox_gives_a_host_user_nothing(home, tmp_path, base):
    async def scenario():
        ws = Workspace(base / "workspaces", f"sg-sec-{uuid.uuid4().hex[:8]}", 256, sandbox_uid())
        await ws.create()
        try:
            async with sandbox(home, tmp_path, ws) as link:
                inside = json.loads(await py(link, SETUID_CELL))
                # The kernel runs without a passwd entry and does not need one.
                ping, _ = await link.request("ping")
                assert ping["kernel_alive"] and ping["kernel_responding"], ping
            # The sandbox is gone (as after a pause), the workspace stays.
            return ws, inside, *host_view(ws)
        finally:
            await ws.delete()
            await reap_mounts(ws.root)
    def host_view(ws):
        target = ws.path / "id"
        st = os.stat(target)
        nobody_blocked = as_nobody(target)
        # Open the way (as the host's root could by mistake) to show that the
        # mount itself makes the setuid bits inert, not only the 0700 directory.
        saved = [(p, os.stat(p).st_mode & 0o7777) for p in (base, ws.root, ws.path)]
        try:
            for p, _ in saved:
                os.chmod(p, 0o711)
            nobody_ran = as_nobody(target)
        finally:
            for p, mode in saved:
                os.chmod(p, mode)
        options = next(line.split()[5] for line in open("/proc/self/mountinfo")
                       if line.split()[4] == os.path.realpath(ws.path))
        return st, nobody_blocked, nobody_ran, options

    ws, inside, st, blocked, ran, options = asyncio.run(scenario())
    uid = sandbox_uid()
    assert inside["uid"] == inside["gid"] == uid and inside["user"] == "sandbox" and inside["home"] == "/workspace"
    assert st.st_mode & (stat.S_ISUID | stat.S_ISGID)  # the bits are there inside the image ...
    assert st.st_uid == st.st_gid == uid  # ... on a file of a uid no account or group has
    with pytest.raises(KeyError):
        pwd.getpwuid(st.st_uid)
    with pytest.raises(KeyError):
        grp.getgrgid(st.st_gid)
    assert os.stat(ws.root).st_mode & 0o777 == 0o700 and os.stat(ws.root).st_uid == 0
    assert blocked.returncode != 0 and "Permission denied" in blocked.stderr, blocked
    assert {"nosuid", "nodev"} <= set(options.split(","))
    assert ran.returncode == 0 and ran.stdout.startswith("uid=65534"), ran
    assert "euid" not in ran.stdout and "egid" not in ran.stdout, ran  # nosuid: no uid or gid gained
