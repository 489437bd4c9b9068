"""The agent-kernel pipe's framing (sandgate_agent/kernel_pipe.py), in
process. The pipe itself runs in every real sandbox: the driver, channel and
agent robustness suites go through it (test_agent_robust checks that the
image's kernel is on it and sends it garbage); on the host, whose ipykernel
is 7.x, the agent's tests run the ZMQ fallback."""

import socket
import threading

import pytest
import zmq

from sandgate_agent import kernel_pipe as KP


def test_frames_round_trip_in_any_pieces():
    msgs = [(KP.SHELL, [b"id", b"<IDS|MSG>", b"", b"{}", b"{}", b"{}", b'{"code": "1+1"}']),
            (KP.IOPUB, [b"topic", zmq.Frame(b"frame part"), memoryview(b"view part"), b""]),
            (KP.HELLO, [b"pipe"]),
            (KP.SHELL, [])]
    stream = b"".join(KP.encode(ch, parts) for ch, parts in msgs)
    want = [(ch, [bytes(memoryview(p)) for p in parts]) for ch, parts in msgs]
    for step in (1, 3, 7, len(stream)):
        d, got = KP.Decoder(), []
        for i in range(0, len(stream), step):
            got += d.feed(stream[i:i + step])
        assert got == want and not d.buf, step


@pytest.mark.parametrize("body", [b"\x05\x00\x00", b"\x09\x00\x00\x00abc", b"\x00\x00\x00\x00\x01"])
def test_a_body_whose_parts_do_not_add_up_is_reported_and_the_next_frame_read(body):
    (ch, bad), after = KP.Decoder().feed(KP.HEAD.pack(KP.SHELL, len(body)) + body + KP.encode(KP.IOPUB, [b"ok"]))
    assert ch == KP.SHELL and isinstance(bad, KP.PipeError)
    assert after == (KP.IOPUB, [b"ok"])


@pytest.mark.parametrize("step", [1, 1000, 65536, 1 << 20])
def test_a_frame_over_the_cap_is_read_past_without_being_held(step):
    big = KP.encode(KP.IOPUB, [b"x" * 300_000, b"y" * 5])
    stream = big + KP.encode(KP.SHELL, [b"after"]) + big[:10]
    d, got = KP.Decoder(cap=100_000), []
    for i in range(0, len(stream), step):
        got += d.feed(stream[i:i + step])
        assert len(d.buf) <= 100_000 + step
    assert got == [(KP.IOPUB, None), (KP.SHELL, [b"after"]), (KP.IOPUB, None)]


def test_the_kernels_end_sends_whole_frames_from_many_threads():
    agent, kernel = KP.pair()
    end = KP.KernelEnd(kernel.detach())
    msgs = [[b"%d" % t, b"z" * (1000 * t)] for t in range(8)]
    threads = [threading.Thread(target=lambda m=m: [end.send(KP.IOPUB, m) for _ in range(50)]) for m in msgs]
    for t in threads:
        t.start()
    d, got = KP.Decoder(), []
    agent.settimeout(30)
    while len(got) < 400:
        got += d.feed(agent.recv(1 << 16))
    for t in threads:
        t.join()
    assert sorted(got) == sorted((KP.IOPUB, m) for m in msgs for _ in range(50))
    end.close()
    agent.close()


def test_the_kernels_end_is_inherited_and_the_agents_is_not():
    agent, kernel = KP.pair()
    try:
        assert kernel.get_inheritable() and not agent.get_inheritable()
        assert agent.family == socket.AF_UNIX and agent.type == socket.SOCK_STREAM
    finally:
        agent.close()
        kernel.close()


def test_an_interrupt_in_a_main_thread_send_waits_for_the_frames_end():
    """KernelEnd.deferred_interrupt stands in for the SIGINT handler ipykernel
    installs: called while the main thread is in a send (here by the reading
    thread, on the first bytes it sees, as the signal would come), it only
    notes the interrupt; the frame goes out whole, then the send raises."""
    agent, kernel = KP.pair()
    end = KP.KernelEnd(kernel.detach())
    big = [b"z" * (4 << 20)]
    got, d = [], KP.Decoder()

    def read():
        first = True
        while len(got) < 2:
            data = agent.recv(1 << 16)
            if first:
                end.deferred_interrupt(2, None)
                first = False
            got.extend(d.feed(data))

    reader = threading.Thread(target=read)
    reader.start()
    with pytest.raises(KeyboardInterrupt):
        end.send(KP.IOPUB, big)
    end.send(KP.SHELL, [b"next"])  # the interrupt was taken once
    reader.join(30)
    assert got == [(KP.IOPUB, big), (KP.SHELL, [b"next"])]
    with pytest.raises(KeyboardInterrupt):  # outside a send, the handler raises at once
        end.deferred_interrupt(2, None)
    end.close()
    agent.close()
