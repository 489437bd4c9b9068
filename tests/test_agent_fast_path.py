"""The agent's shell fast path (ShellFastPath in sandgate_agent/agent.py), in
process: what the stdin thread writes straight to the kernel's pipe and what
it hands to the event loop, byte for byte and in order. In real gVisor
sandboxes (stdio transport) every suite's cells take this path."""

import asyncio
import json
import socket
import threading
import types

import pytest

from sandgate_agent import agent as A
from sandgate_agent import kernel_pipe as KP
from sandgate_agent import protocol as P


def kernel_frame(channel, code="1+1", msg_id="m1"):
    header = json.dumps({"msg_id": msg_id, "msg_type": "execute_request"}).encode()
    parts = [header, b"{}", b"{}", json.dumps({"code": code}).encode()]
    return P.encode_kernel(channel, parts), parts


def request_frame(op="ping"):
    return P.encode(P.RequestFrame(id=1, op=op))


class Rig:
    """An agent as far as the fast path sees it, and the kernel's end of its pipe."""

    def __init__(self, ready=True, on_pipe=True):
        agent_end, self.kernel_end = socket.socketpair()
        agent_end.setblocking(False)
        self.kernel_end.settimeout(10)
        kernel = A.KernelProcess.__new__(A.KernelProcess)
        kernel.pipe, kernel.on_pipe, kernel.ident = agent_end, on_pipe, b"ident"
        kernel.session = A.KernelSession()
        self.ready = asyncio.Event()
        if ready:
            self.ready.set()
        self.agent = types.SimpleNamespace(ready=self.ready, kernel=kernel, trace_in=lambda *a: None)
        self.fast = A.ShellFastPath(self.agent)
        self.decoder = KP.Decoder()

    def kernel_got(self, n):
        got = []
        while len(got) < n:
            got += self.decoder.feed(self.kernel_end.recv(1 << 16))
        return got

    def close(self):
        self.kernel_end.close()
        self.agent.kernel.pipe.close()


@pytest.fixture
def rig():
    r = Rig()
    yield r
    r.close()


def test_shell_goes_to_the_kernel_and_the_rest_to_the_loop_in_order(rig):
    shell, parts = kernel_frame("shell")
    control, _ = kernel_frame("control", msg_id="m2")
    req = request_frame()
    stream = req + shell + control + shell
    for step in (1, 5, len(stream)):  # any way the reads split it
        handed = b"".join(rig.fast.take(stream[i:i + step], 0.0) for i in range(0, len(stream), step))
        assert handed == req + control
        (ch1, got1), (ch2, got2) = rig.kernel_got(2)
        assert ch1 == ch2 == KP.SHELL and got1 == got2
        assert got1[:2] == [b"ident", A.DELIM] and got1[3:] == parts
        assert got1[2] == rig.agent.kernel.session.sign(parts)
        assert rig.fast.handed == 0


def test_while_the_kernel_is_not_ready_shell_waits_in_the_loop_and_order_holds(rig):
    first, _ = kernel_frame("shell", "a = 1", "m1")
    second, _ = kernel_frame("shell", "a += 1", "m2")
    rig.ready.clear()
    assert rig.fast.take(first, 0.0) == first  # handed to the loop
    rig.ready.set()
    # The loop has not sent `first` yet: `second` must queue behind it.
    assert rig.fast.take(second, 0.0) == second
    assert rig.fast.handed == 2
    rig.fast.sent_one()
    rig.fast.sent_one()
    third, parts = kernel_frame("shell", "a", "m3")
    assert rig.fast.take(third, 0.0) == b""
    assert rig.kernel_got(1)[0][1][3:] == parts


def test_a_kernel_on_zmq_gets_everything_through_the_loop():
    r = Rig(on_pipe=False)
    try:
        shell, _ = kernel_frame("shell")
        assert r.fast.take(shell, 0.0) == shell and r.fast.handed == 1
    finally:
        r.close()


def test_a_large_frame_streams_to_the_loop_without_being_held(rig):
    payload = b"x" * (3 << 20)
    big = P.encode(P.RequestFrame(id=2, op="file_write", args={"path": "f", "mode": 420}), payload)
    shell, _ = kernel_frame("shell")
    chunk = 1 << 20
    handed = []
    for i in range(0, len(big + shell), chunk):
        handed.append(rig.fast.take((big + shell)[i:i + chunk], 0.0))
        assert len(rig.fast.buf) <= chunk
    assert b"".join(handed) == big
    assert rig.kernel_got(1)[0][0] == KP.SHELL


def test_a_stream_that_does_not_parse_goes_to_the_loop_from_there_on(rig):
    shell, _ = kernel_frame("shell")
    bad = P.PREFIX.pack(5, 0) + b"nope!"
    assert rig.fast.take(shell + bad + shell, 0.0) == bad + shell
    assert rig.fast.passthrough
    assert rig.fast.take(shell, 0.0) == shell
    assert len(rig.kernel_got(1)) == 1


def test_a_failure_inside_take_loses_no_bytes(rig, monkeypatch):
    req, shell = request_frame(), kernel_frame("shell")[0]
    monkeypatch.setattr(rig.fast, "direct", lambda *a: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        rig.fast.take(req + shell + req, 0.0)
    assert rig.fast.give_up() == req + shell + req
    assert rig.fast.take(shell, 0.0) == shell


def test_a_full_pipe_blocks_the_stdin_thread_not_the_loop(rig):
    """The kernel reads nothing: the stdin thread waits on the full pipe while
    the loop's own shell write waits in a worker thread, and both go through,
    whole, once the kernel reads."""
    k = rig.agent.kernel
    big, _ = kernel_frame("shell", "x" * 900_000)
    writer = threading.Thread(target=lambda: [rig.fast.take(big, 0.0) for _ in range(6)])
    writer.start()

    async def loop_side():
        sent = asyncio.ensure_future(k.send("shell", kernel_frame("shell", "own", "own")[1]))
        await asyncio.sleep(0)  # the loop stays free meanwhile
        got = await asyncio.get_running_loop().run_in_executor(None, rig.kernel_got, 7)
        await asyncio.wait_for(sent, 30)
        return got

    got = asyncio.run(loop_side())
    writer.join(30)
    assert not writer.is_alive()
    codes = sorted(json.loads(parts[6])["code"][:3] for _, parts in got)
    assert codes == ["own"] + ["xxx"] * 6
