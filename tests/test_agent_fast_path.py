"""The agent's shell fast path (ShellFastPath in sandgate_agent/fast_path.py), in
process: what the stdin thread writes straight to the kernel's pipe and what
it hands to the event loop, byte for byte and in order. In real gVisor
sandboxes (stdio transport) every suite's cells take this path."""

import asyncio
import json
import socket
import types

import pytest

from sandgate_agent import kernel_pipe as KP
from sandgate_agent import kernel_process as KPR
from sandgate_agent import protocol as P
from sandgate_agent.fast_path import ShellFastPath


def kernel_frame(channel, code="1+1", msg_id="m1"):
    header = json.dumps({"msg_id": msg_id, "msg_type": "execute_request"}).encode()
    parts = [header, b"{}", b"{}", json.dumps({"code": code}).encode()]
    return P.encode_kernel(channel, parts), parts


def request_frame(op="ping"):
    return P.encode(P.RequestFrame(id=1, op=op))


class Rig:
    """An agent as far as the fast path sees it, and the kernel's end of its pipe."""

    def __init__(self, ready=True, on_pipe=True, loop=None):
        agent_end, self.kernel_end = socket.socketpair()
        self.kernel_end.settimeout(10)
        self.loop = loop or asyncio.new_event_loop()  # runs only where a test needs the queue drained
        kernel = KPR.KernelProcess.__new__(KPR.KernelProcess)
        kernel.pipe, kernel.on_pipe, kernel.ident = KP.AgentEnd(agent_end, self.loop), on_pipe, b"ident"
        kernel.session = KPR.KernelSession()
        self.ready = asyncio.Event()
        if ready:
            self.ready.set()
        self.agent = types.SimpleNamespace(ready=self.ready, kernel=kernel, trace_in=lambda *a: None)
        self.fast = ShellFastPath(self.agent)
        self.decoder = KP.Decoder()

    def kernel_got(self, n):
        got = []
        while len(got) < n:
            got += self.decoder.feed(self.kernel_end.recv(1 << 16))
        return got

    def close(self):
        self.kernel_end.close()
        self.agent.kernel.pipe.sock.close()


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
        assert got1[:2] == [b"ident", KPR.DELIM] and got1[3:] == parts
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


def test_a_kernel_that_reads_nothing_blocks_neither_the_stdin_thread_nor_the_loop():
    """A long cell: the kernel reads no requests. The stdin thread's frames and
    the loop's own queue behind what the pipe holds, neither waits, and all of
    them reach the kernel whole and in order once it reads again."""
    async def main():
        r = Rig(loop=asyncio.get_running_loop())
        big, _ = kernel_frame("shell", "x" * 900_000)
        try:
            for i in range(6):  # several MB: far more than the socket holds
                assert r.fast.take(big, 0.0) == b""
            assert r.agent.kernel.pipe.queued > 0
            await asyncio.wait_for(r.agent.kernel.send("shell", kernel_frame("shell", "own", "own")[1]), 5)
            got = await asyncio.get_running_loop().run_in_executor(None, r.kernel_got, 7)
            assert [json.loads(parts[6])["code"][:3] for _, parts in got] == ["xxx"] * 6 + ["own"]
            assert r.agent.kernel.pipe.queued == 0 and not r.agent.kernel.pipe.armed
        finally:
            r.close()

    asyncio.run(main())


def test_past_the_queues_limit_the_loop_waits_and_the_stdin_thread_hands_over(monkeypatch):
    monkeypatch.setattr(KP.AgentEnd, "LIMIT", 1 << 20)

    async def main():
        r = Rig(loop=asyncio.get_running_loop())
        big, _ = kernel_frame("shell", "x" * 900_000)
        try:
            pipe, sent_direct = r.agent.kernel.pipe, 0
            while not pipe.full:
                assert r.fast.take(big, 0.0) == b""
                sent_direct += 1
            assert r.fast.take(big, 0.0) == big and r.fast.handed == 1  # the loop sends it when there is room
            sent = asyncio.ensure_future(r.agent.kernel.send("shell", kernel_frame("shell", "own", "own")[1]))
            for _ in range(5):  # the loop runs on; the send stays parked until the kernel reads
                await asyncio.sleep(0)
            assert not sent.done()
            got = await asyncio.get_running_loop().run_in_executor(None, r.kernel_got, sent_direct + 1)
            await asyncio.wait_for(sent, 10)
            assert [json.loads(parts[6])["code"][:3] for _, parts in got][-1] == "own"
        finally:
            r.close()

    asyncio.run(main())


def test_a_write_after_the_kernel_is_gone_is_dropped_not_raised():
    async def main():
        r = Rig(loop=asyncio.get_running_loop())
        r.kernel_end.close()
        r.agent.kernel.pipe.close()
        await r.agent.kernel.send("shell", kernel_frame("shell")[1])  # logged, no exception
        shell, _ = kernel_frame("shell")
        assert r.fast.take(shell, 0.0) == shell and r.fast.handed == 1

    asyncio.run(main())
