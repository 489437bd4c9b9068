"""core/fanout.py directly: which client gets a kernel message, what is kept for a client that is
not there, the replay buffer's bounds, and the per-client iopub rate limit."""

from __future__ import annotations

import json
import logging

from sandgate.core.fanout import FanOut, IopubLimiter


class Client:
    def __init__(self, session: str, replay: bool = True):
        self.session_ids, self.replay, self.got = {session}, replay, []

    def deliver(self, channel, parts):
        self.got.append((channel, parts))


def msg(msg_type: str = "stream", session: str = "s", size: int = 0) -> list:
    header = json.dumps({"msg_type": msg_type, "session": session}).encode()
    parent = json.dumps({"session": session}).encode()
    return [header, parent, b"{}", b"x" * size]


def test_iopub_goes_to_every_client_and_replies_to_the_asking_session():
    f = FanOut("sb", replay_messages=10)
    a, b, collector = Client("a"), Client("b"), Client("c", replay=False)
    for c in (a, b, collector):
        f.attach(c)
    assert len(f) == 3
    out = msg("stream")
    f.route("iopub", out)
    assert a.got == b.got == collector.got == [("iopub", out)]
    reply = msg("execute_reply", session="b")
    f.route("shell", reply)
    assert b.got[-1] == ("shell", reply) and len(a.got) == 1 and len(collector.got) == 1
    # No client of that session: every websocket client, never an execute call's collector.
    stray = msg("execute_reply", session="gone")
    f.route("shell", stray)
    assert a.got[-1] == b.got[-1] == ("shell", stray) and len(collector.got) == 1
    # A parent header that is not JSON is no session: the same.
    bad = [msg()[0], b"not json", b"{}", b"{}"]
    f.route("stdin", bad)
    assert a.got[-1] == ("stdin", bad) and len(collector.got) == 1
    f.detach(a)
    f.detach(a)  # twice is harmless
    f.route("iopub", out)
    assert len(a.got) == 3 and b.got[-1] == ("iopub", out) and len(f) == 2


def test_what_comes_while_no_client_is_attached_is_replayed_once_in_order():
    f = FanOut("sb", replay_messages=10)
    sent = [("iopub", msg("stream", size=i)) for i in range(3)] + [("shell", msg("execute_reply"))]
    for channel, parts in sent:
        f.route(channel, parts)
    collector = Client("c", replay=False)
    f.attach(collector)  # an execute call's collector does not take the buffer
    assert collector.got == [] and len(f.replay) == 4
    first = Client("a")
    f.attach(first)
    assert first.got == sent and len(f.replay) == 0 and f.replay_bytes == 0
    second = Client("b")
    f.attach(second)
    assert second.got == []
    # With only a collector attached, a reply no session claims is kept for the one that reconnects.
    f.detach(first)
    f.detach(second)
    f.route("shell", msg("execute_reply", session="nobody"))
    assert len(f.replay) == 1 and collector.got == []


def test_the_replay_buffer_is_bounded_and_says_what_it_dropped(caplog):
    f = FanOut("sb-bounded", replay_messages=3)
    for i in range(5):
        f.route("iopub", msg(size=i))
    assert len(f.replay) == 3 and f.dropped == 2
    small = msg(size=1)
    f.REPLAY_BYTES = f.replay_bytes + sum(map(len, small)) + 50  # room for one small message more, not a big one
    f.max_messages = 10
    f.route("iopub", small)
    f.route("iopub", msg(size=100))
    assert len(f.replay) == 4 and f.dropped == 3
    c = Client("a")
    with caplog.at_level(logging.WARNING, logger="sandgate.fanout"):
        f.attach(c)
    assert len(c.got) == 4 and f.dropped == 0
    assert "sandbox sb-bounded: 3 messages dropped while no client was connected" in caplog.text
    f.route("iopub", msg())
    f.detach(c)
    f.route("iopub", msg())
    f.clear()
    assert len(f.replay) == 0 and f.replay_bytes == 0 and f.dropped == 0


def test_iopub_limiter_drops_past_the_message_rate_and_resumes_below_80_percent(caplog):
    lim = IopubLimiter(msg_rate=10, data_rate=0, window=1.0)
    t = 100.0
    assert all(lim.drop(msg("display_data"), t) is None for _ in range(10))
    notice = lim.drop(msg("display_data"), t)  # the 11th within the window: over 10/s
    assert isinstance(notice, str) and "message rate exceeded (10 messages/s)" in notice
    assert lim.drop(msg("display_data"), t) == "drop"
    assert lim.drop(msg("status"), t) is None  # status is never dropped: clients wait for idle
    assert lim.drop(msg("display_data"), t) == "drop"
    with caplog.at_level(logging.WARNING, logger="sandgate.fanout"):
        assert lim.drop(msg("display_data"), t + 1.5) is None  # the window has passed
    assert "iopub output resumed after 3 messages were dropped for one client" in caplog.text


def test_iopub_limiter_counts_only_stream_bytes_against_the_data_rate():
    lim = IopubLimiter(msg_rate=0, data_rate=1000, window=1.0)
    assert lim.drop(msg("display_data", size=5000), 0.0) is None  # not a stream: no bytes counted
    assert lim.drop(msg("stream", size=900), 0.0) is None
    notice = lim.drop(msg("stream", size=200), 0.0)
    assert isinstance(notice, str) and "data rate exceeded (1000 bytes/s of output)" in notice
    assert lim.drop(msg("stream", size=1), 0.5) == "drop"
    assert lim.drop(msg("stream", size=1), 2.0) is None
