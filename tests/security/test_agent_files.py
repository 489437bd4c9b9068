"""The files API must not make the agent (root inside the
sandbox, with CAP_DAC_OVERRIDE) a deputy for the code it serves.

A racer inside swaps a workspace directory for a symlink to /proc/1 (or to a
root-only directory) while a client reads through it; symlinks in the
workspace are never followed; files are read and written as the sandbox user.
Real sandboxes behind a real gateway, for every driver the agent runs in."""

import asyncio
import json
import os
import subprocess
import sys
import time

import pytest

from conftest import wait_for
from sandgate.agent_link import AgentError, AgentLink
from sandgate_agent import protocol as P



def ex(gw, sid, code):
    r = gw.request("POST", f"/api/sandboxes/{sid}/execute", {"code": code, "timeout": 120})
    assert r.status == 200, r.body
    out = r.json()
    assert out["status"] == "ok", out
    return out["stdout"]


# Targets only root may read inside the sandbox: /proc/1 is the agent
# (exe is its python binary, environ its environment, both root-only through
# /proc), and /var/cache/debconf/passwords.dat is a 0600 root file.
BENIGN = ("exe", "environ", "passwords.dat")
RACER = """
import os, threading, time
os.chdir('/workspace')
os.makedirs('race/d', exist_ok=True)
for name in %(names)r:
    with open(f'race/d/{name}', 'w') as f:
        f.write('benign ' + name)
for link, target in (('race/to_proc', '/proc/1'), ('race/to_root', '/var/cache/debconf')):
    if not os.path.lexists(link):
        os.symlink(target, link)
race_stop, race_swaps = threading.Event(), [0]

def race():
    links = ['race/to_proc', 'race/to_root']
    deadline = time.monotonic() + %(limit)d  # in case the test never stops it
    while not race_stop.is_set() and time.monotonic() < deadline:
        link = links[race_swaps[0] %% 2]
        os.rename('race/d', 'race/d.real')
        os.rename(link, 'race/d')  # now race/d is a symlink out of the workspace
        os.rename('race/d', link)
        os.rename('race/d.real', 'race/d')
        race_swaps[0] += 1

race_thread = threading.Thread(target=race, daemon=True)
race_thread.start()
"""


def test_a_racing_symlink_swap_never_leaks_root_only_files(gw, sb):
    """A read through a swapped directory that followed the symlink would return
    /proc/1/exe (an ELF binary), the agent's environment or a 0600 file."""
    ex(gw, sb, RACER % {"names": BENIGN, "limit": 120})
    statuses, leaks, reads = {}, [], 0
    deadline = time.monotonic() + 20
    try:
        while time.monotonic() < deadline:
            name = BENIGN[reads % len(BENIGN)]
            listing = reads % 4 == 3
            r = gw.request("GET", f"/api/sandboxes/{sb}/files/race/d/" + ("" if listing else name), timeout=30)
            reads += 1
            statuses[r.status] = statuses.get(r.status, 0) + 1
            if r.status != 200:
                continue
            if listing:
                names = {e["name"] for e in r.json()["entries"]}
                if not names <= set(BENIGN):
                    leaks.append(("listing", sorted(names)[:10]))
            elif r.body != f"benign {name}".encode():
                leaks.append((name, r.body[:40]))
    finally:
        swaps = ex(gw, sb, "race_stop.set(); race_thread.join(); print(race_swaps[0])")
        print(f"{gw.driver}: {reads} reads, {int(swaps or 0)} swaps, statuses {statuses}, {len(leaks)} leaks")
    assert not leaks, f"{len(leaks)} of {reads} reads leaked through the symlink swap: {leaks[:5]}"
    # The race really ran: the directory moved many times, reads got through.
    assert int(swaps) > 100 and statuses.get(200, 0) > 50, (swaps, statuses)
    # 404 while race/d is briefly missing, 403 while it is a symlink; no 500.
    assert set(statuses) <= {200, 403, 404}, statuses


SETUP_LINKS = """
import os
os.chdir('/workspace')
open('/tmp/victim.txt', 'w').write('victim')
open('inside.txt', 'w').write('inside')
os.makedirs('sub', exist_ok=True)
for link, target in (('link_file', '/tmp/victim.txt'), ('link_dir', '/tmp'), ('link_inside', 'inside.txt'),
                     ('sub/link_up', '..')):
    if not os.path.lexists(link):
        os.symlink(target, link)
"""


def test_symlinks_in_the_workspace_are_never_followed(gw, sb):
    ex(gw, sb, SETUP_LINKS)
    base = f"/api/sandboxes/{sb}/files"
    entries = {e["name"]: e["type"] for e in gw.request("GET", base + "/").json()["entries"]}
    assert entries["link_file"] == entries["link_dir"] == entries["link_inside"] == "symlink"
    for path in ("link_file", "link_dir/victim.txt", "link_dir/", "link_inside", "sub/link_up/inside.txt"):
        r = gw.request("GET", f"{base}/{path}")
        assert r.status == 403, (path, r.status, r.body)
    for path in ("link_file", "link_dir/victim.txt", "link_dir/new.txt", "link_inside", "sub/link_up/x.txt"):
        r = gw.request("PUT", f"{base}/{path}", raw=b"overwritten")
        assert r.status == 403, (path, r.status, r.body)
    r = gw.request("DELETE", f"{base}/link_dir/victim.txt")
    assert r.status == 403, r.body
    # Deleting a symlink removes the link itself, never what it points to.
    assert gw.request("DELETE", f"{base}/link_file").status == 204
    state = json.loads(ex(gw, sb, """
import json, os
print(json.dumps({'victim': open('/tmp/victim.txt').read(), 'new': os.path.exists('/tmp/new.txt'),
                  'link_file': os.path.lexists('/workspace/link_file'),
                  'inside': open('/workspace/inside.txt').read(), 'x': os.path.exists('/workspace/x.txt')}))
"""))
    assert state == {"victim": "victim", "new": False, "link_file": False, "inside": "inside", "x": False}


def test_files_are_read_and_written_as_the_sandbox_user(gw, sb):
    """With CAP_DAC_OVERRIDE the agent could read and write what the kernel's
    own user cannot; it acts as that user instead."""
    ex(gw, sb, """
import os
os.chdir('/workspace')
open('private.txt', 'w').write('private')
os.chmod('private.txt', 0)
os.makedirs('locked', exist_ok=True)
os.chmod('locked', 0o500)
""")
    base = f"/api/sandboxes/{sb}/files"
    r = gw.request("GET", f"{base}/private.txt")
    assert r.status == 403, (r.status, r.body)
    r = gw.request("PUT", f"{base}/locked/new.txt", raw=b"x")
    assert r.status == 403, (r.status, r.body)
    assert gw.request("PUT", f"{base}/made/by/api.txt", raw=b"hello").status == 201
    owners = json.loads(ex(gw, sb, """
import json, os
print(json.dumps([os.stat(p).st_uid == os.getuid() for p in ('/workspace/made', '/workspace/made/by',
                                                              '/workspace/made/by/api.txt')]
                 + [os.path.exists('/workspace/locked/new.txt')]))
"""))
    assert owners == [True, True, True, False]
    assert gw.request("GET", f"{base}/made/by/api.txt").body == b"hello"
    ex(gw, sb, "import os; os.chmod('/workspace/locked', 0o700); os.chmod('/workspace/private.txt', 0o600)")


def test_a_fifo_is_refused_without_wedging_the_agent(gw, sb):
    """Opening a FIFO for reading blocks until a writer comes: the agent
    must refuse it rather than hang its event loop."""
    made = ex(gw, sb, """
import os
try:
    os.mkfifo('/workspace/fifo')
    print('made')
except OSError as e:
    print(e)
""").strip()
    if made != "made":
        pytest.skip(f"no FIFOs in this workspace: {made}")
    r = gw.request("GET", f"/api/sandboxes/{sb}/files/fifo", timeout=30)
    assert r.status == 403, (r.status, r.body)
    assert gw.request("GET", f"/api/sandboxes/{sb}/files/").status == 200
    assert gw.request("DELETE", f"/api/sandboxes/{sb}/files/fifo").status == 204


@pytest.fixture
def host_agent(tmp_path):
    """The agent on its own, as the tests' user, over a unix socket: for exec,
    which the gateway does not call."""
    sock = str(tmp_path / "agent.sock")
    log = open(tmp_path / "agent.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "sandgate_agent.agent", "--transport", f"unix:{sock}",
                             "--workspace", str(tmp_path / "ws"), "--runtime-dir", str(tmp_path / "rt")],
                            stderr=log)
    wait_for(lambda: os.path.exists(sock) or proc.poll() is not None, timeout=60, interval=0.1)
    assert proc.poll() is None, (tmp_path / "agent.log").read_text()
    yield sock, tmp_path / "ws"
    proc.kill()
    proc.wait()
    log.close()


def test_exec_cwd_is_walked_like_a_file_path(host_agent, tmp_path):
    sock, ws = host_agent
    (ws / "real").mkdir()
    (ws / "link").symlink_to(tmp_path)
    (ws / "real" / "up").symlink_to("..")

    async def main():
        reader, writer = await asyncio.open_unix_connection(sock, limit=P.MAX_PAYLOAD)
        link = AgentLink(reader, writer, lambda ch, parts: None, lambda ev: None)
        await asyncio.wait_for(link.ready, 60)
        for cwd, expect in (("", ws), ("real", ws / "real"), ("real/../real", ws / "real")):
            res, out = await link.request("exec", {"argv": ["pwd", "-P"], "cwd": cwd})
            assert res["exit_code"] == 0 and out.decode().strip() == str(ws.resolve() / expect.relative_to(ws)), out
        for cwd, why in (("link", "refusing"), ("real/up", "refusing"), ("link/x", "refusing"),
                         ("..", "outside the workspace")):
            with pytest.raises(AgentError, match=why):
                await link.request("exec", {"argv": ["pwd"], "cwd": cwd})
        await link.close()

    asyncio.run(main())
