"""A cell cannot wedge its own sandbox by sending
malformed messages on the kernel's sockets; restart always recovers. And the
kernel and everything it starts run with no_new_privs: setuid binaries inside
do not elevate.

Real sandboxes behind a real gateway, for every driver the agent runs in,
plus the agent on its own for what the gateway does not reach (exec)."""

import asyncio
import json
import os
import subprocess
import sys
import time

import pytest

from conftest import wait_for
from sandgate.agent_link import AgentLink
from sandgate_agent import protocol as P



def ex(gw, sid, code, timeout=60):
    r = gw.request("POST", f"/api/sandboxes/{sid}/execute", {"code": code, "timeout": timeout},
                   timeout=timeout + 30)
    assert r.status == 200, r.body
    return r.json()


# Sent through the kernel's own sockets, as any cell can: the iopub PUB that
# the agent's SUB reads, and the shell ROUTER towards the agent's DEALER.
GARBAGE = r'''
import uuid
k = get_ipython().kernel
D = b"<IDS|MSG>"
own = ('{"msg_id": "sandgate-agent-%s"}' % uuid.uuid4().hex).encode()
status = b'{"msg_id": "x", "msg_type": "status", "session": "s", "username": "u", "date": "", "version": "5.3"}'
garbage = [
    [b"topic"],                                              # no delimiter
    [D],                                                     # nothing after it
    [D, b"sig", b"{}"],                                      # too few parts
    [D, b"", status, b"not json sandgate-agent-", b"{}", b"{}"],
    [D, b"", status, b'["sandgate-agent-"]', b"{}", b"{}"],
    [D, b"", status, own, b"{}", b"\xff\xfe"],              # the agent's prefix, content not JSON
    [D, b"", status, own, b"{}", b"[1]"],
    [D, b"", status, b"{}", b"{}", b"[1]"],                  # the gateway reads a status's content
    [D, b"", b"\xff", b"{}", b"{}", b"{}"],
    [D, b"", b"[" * 100000, b"{}", b"{}", b"{}"],             # too deep to parse
    [D, b"", b'{"msg_id": 1, "msg_type": "stream"}', b"{}", b"{}", b"{}"],
]
for g in garbage:
    k.iopub_socket.send_multipart(g)
ident = k._parent_ident["shell"]
for g in garbage:
    k.shell_stream.send_multipart(list(ident) + g)
# The image's ipykernel (6.x) sends shell and IOPub over the agent's pipe
# (kernel_pipe.py): also bytes on it that are no Jupyter message, framed well.
end = getattr(k.shell_stream, "end", None)
if end is not None:
    import struct
    with end.lock:
        end.sock.sendall(struct.pack("<BI", 9, 0))                        # no such channel
        end.sock.sendall(struct.pack("<BI", 2, 3) + b"\x05\x00\x00")   # a part longer than the body
        end.sock.sendall(struct.pack("<BI", 1, 4) + struct.pack("<I", 0))  # one empty part
print("sent", len(garbage), "pipe" if end is not None else "zmq")
'''


def test_garbage_from_the_kernel_does_not_wedge_the_sandbox(gw, sb):
    # A legacy websocket client attached: the gateway encodes every message
    # the agent forwards as JSON for it.
    c = gw.connect(sb)
    try:
        out = ex(gw, sb, GARBAGE)
        assert out["status"] == "ok" and out["stdout"] == "sent 11 pipe\n", out
        out = ex(gw, sb, "1+1")
        assert out["status"] == "ok" and out["outputs"][-1]["data"] == {"text/plain": "2"}, out
    finally:
        c.close()
    assert gw.request("GET", f"/api/kernels/{sb}").json()["execution_state"] != "dead"
    assert ex(gw, sb, "print('still fine')")["stdout"] == "still fine\n"


def test_restart_recovers_in_place_after_garbage(gw, sb):
    before = gw.request("GET", f"/api/sandboxes/{sb}").json()["runtime_id"]
    assert ex(gw, sb, GARBAGE + "\nx = 41")["status"] == "ok"
    t0 = time.monotonic()
    r = gw.request("POST", f"/api/kernels/{sb}/restart")
    assert r.status == 200, r.body
    took = time.monotonic() - t0
    out = ex(gw, sb, "print('x' in dir(), 1 + 1)")
    assert out["stdout"] == "False 2\n", out
    # Restarted inside the same sandbox, not recreated after the agent failed.
    assert gw.request("GET", f"/api/sandboxes/{sb}").json()["runtime_id"] == before
    assert "in-sandbox restart failed" not in gw.log_text(), took


NO_NEW_PRIVS = r'''
import ctypes, json, subprocess, time
nnp = ctypes.CDLL(None).prctl(39, 0, 0, 0, 0)  # PR_GET_NO_NEW_PRIVS
line = subprocess.run(['grep', 'NoNewPrivs', '/proc/self/status'], capture_output=True, text=True).stdout.split()
# su is setuid root in the image. Honoured, it runs with euid 0 while it waits
# for a password on its stdin (kept open); with no_new_privs it stays the user.
p = subprocess.Popen(['su', '-c', 'true'], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL)
uids, deadline = None, time.monotonic() + 30
while uids is None and p.poll() is None and time.monotonic() < deadline:
    try:
        fields = dict(l.split(':', 1) for l in open(f'/proc/{p.pid}/status').read().splitlines() if ':' in l)
    except OSError:
        break
    if fields.get('Name', '').strip() == 'su':
        uids = [int(u) for u in fields['Uid'].split()]
    else:
        time.sleep(0.01)
p.kill()
p.wait()
print(json.dumps({'nnp': nnp, 'status': line[1:], 'su_uids': uids}))
'''


def test_the_kernel_cannot_gain_privileges(gw, sb):
    out = json.loads(ex(gw, sb, NO_NEW_PRIVS)["stdout"])
    assert out["nnp"] == 1, out
    # gVisor's /proc/self/status has no NoNewPrivs line; a VM's has.
    assert out["status"] in ([], ["1"]), out
    assert out["su_uids"] is not None, out  # su was seen running
    assert 0 not in out["su_uids"], out  # real, effective, saved, filesystem uid


@pytest.fixture
def host_agent(tmp_path):
    """The agent on its own, as the tests' user, over a unix socket."""
    sock = str(tmp_path / "agent.sock")
    log = open(tmp_path / "agent.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "sandgate_agent.agent", "--transport", f"unix:{sock}",
                             "--workspace", str(tmp_path / "ws"), "--runtime-dir", str(tmp_path / "rt")],
                            stderr=log)
    wait_for(lambda: os.path.exists(sock) or proc.poll() is not None, timeout=60, interval=0.1)
    assert proc.poll() is None, (tmp_path / "agent.log").read_text()
    yield sock
    proc.kill()
    proc.wait()
    log.close()


def test_commands_the_agent_runs_cannot_gain_privileges(host_agent):
    """exec is not reached through the gateway: the agent on its own. The
    test process itself has no no_new_privs, so the agent set it."""
    assert "NoNewPrivs:\t0" in open("/proc/self/status").read()

    async def main():
        reader, writer = await asyncio.open_unix_connection(host_agent, limit=P.MAX_PAYLOAD)
        link = AgentLink(reader, writer, lambda ch, parts: None, lambda ev: None)
        ready = await asyncio.wait_for(link.ready, 60)
        res, out = await link.request("exec", {"argv": ["grep", "NoNewPrivs", "/proc/self/status"]})
        assert res["exit_code"] == 0 and out.split() == [b"NoNewPrivs:", b"1"], out
        kernel = open(f"/proc/{ready['pid']}/status").read()
        assert "NoNewPrivs:\t1" in kernel
        await link.close()

    asyncio.run(main())


def test_copies_of_one_checkpoint_get_their_own_kernel_session_and_randomness(gw, sb):
    """Every sandbox restored from one checkpoint (the warm-start template,
    forks) would carry that checkpoint's ipykernel session id in its messages'
    headers; setup gives each its own. In a VM the copies' kernel random
    generators also resume identical, so the ids setup draws, and its reseed of
    `random`, would be the same in every copy: the agent has the guest kernel
    reseed at the restore."""
    ask = "import random; print(get_ipython().kernel.session.session, random.random())"
    own = ex(gw, sb, ask)["stdout"].split()
    r = gw.request("POST", f"/api/sandboxes/{sb}/checkpoints", {})
    assert r.status == 201, r.body
    cp = r.json()["id"]
    forks = []
    try:
        for _ in range(2):
            r = gw.request("POST", f"/api/sandboxes/{sb}/fork", {"checkpoint": cp})
            assert r.status == 201, r.body
            forks.append(r.json()["id"])
        copies = [ex(gw, f, ask)["stdout"].split() for f in forks]
    finally:
        for f in forks:
            gw.request("DELETE", f"/api/sandboxes/{f}")
    assert len({own[0], copies[0][0], copies[1][0]}) == 3, (own, copies)
    assert copies[0][1] != copies[1][1], copies
