"""The guest agent on its own: a real agent process with a real ipykernel,
driven over its framed stream (unix socket transport, so the stream can be
dropped and re-opened the way a restarting gateway would)."""

import asyncio
import collections
import itertools
import json
import os
import subprocess
import sys
import time
import uuid

import pytest

from sandgate.agent_link import AgentError, AgentLink
from sandgate_agent import protocol as P


def execute_parts(code, session="t"):
    h = {"msg_id": uuid.uuid4().hex, "msg_type": "execute_request", "session": session, "username": "t",
         "date": "2026-01-01T00:00:00Z", "version": "5.3"}
    return h["msg_id"], [json.dumps(h).encode(), b"{}", b"{}", json.dumps({"code": code, "silent": False}).encode()]


class Conn:
    """One connection to the agent's unix socket."""

    def __init__(self, link, queue, events):
        self.link, self.queue, self.events = link, queue, events

    @classmethod
    async def open(cls, path):
        reader, writer = await asyncio.open_unix_connection(path, limit=P.MAX_PAYLOAD)
        q, ev = asyncio.Queue(), []
        link = AgentLink(reader, writer, lambda ch, parts: q.put_nowait((ch, parts)), ev.append)
        await asyncio.wait_for(link.ready, 30)
        return cls(link, q, ev)

    async def until_idle(self, msg_id, timeout=30):
        got = []
        while True:
            ch, parts = await asyncio.wait_for(self.queue.get(), timeout)
            got.append((ch, json.loads(parts[0])["msg_type"], json.loads(parts[3])))
            if ch == "iopub" and msg_id.encode() in parts[1] and b'"idle"' in parts[3]:
                return got

    async def until_done(self, msg_id, timeout=30):
        """Until both the execute_reply (shell) and the idle status (iopub):
        they travel on two ZMQ sockets, so either may arrive first."""
        got, reply, idle = [], False, False
        while not (reply and idle):
            ch, parts = await asyncio.wait_for(self.queue.get(), timeout)
            got.append((ch, json.loads(parts[0])["msg_type"], json.loads(parts[3])))
            if msg_id.encode() in parts[1]:
                reply = reply or (ch == "shell" and got[-1][1] == "execute_reply")
                idle = idle or (ch == "iopub" and b'"idle"' in parts[3])
        return got


async def until_exists(path, timeout=60):
    """Until a cell has made this file (the kernel's working directory is the workspace)."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        await asyncio.sleep(0.05)


@pytest.fixture
def agent(tmp_path):
    sock = str(tmp_path / "agent.sock")
    proc = subprocess.Popen([sys.executable, "-m", "sandgate_agent.agent", "--transport", f"unix:{sock}",
                             "--workspace", str(tmp_path / "ws"), "--runtime-dir", str(tmp_path / "rt"),
                             "--buffer-frames", "50"], stderr=open(tmp_path / "agent.log", "w"))
    deadline = time.monotonic() + 60
    while not os.path.exists(sock):
        assert proc.poll() is None, (tmp_path / "agent.log").read_text()
        assert time.monotonic() < deadline
        time.sleep(0.1)
    yield sock, tmp_path / "ws"
    proc.kill()
    proc.wait()


def test_reconnect_keeps_kernel_state_and_buffers_output(agent):
    sock, ws = agent

    async def main():
        a = await Conn.open(sock)
        mid, parts = execute_parts("x = 41")
        a.link.send_kernel("shell", parts)
        await a.until_idle(mid)
        # The cell prints only once the test says so: a fixed sleep could end, on a loaded host,
        # before the stream below is closed, and its output would go to that stream.
        mid, parts = execute_parts("import os, sys, time\nwhile not os.path.exists('go'): time.sleep(0.05)\n"
                                   "print('late'); sys.stdout.flush()\nopen('printed', 'w').close()")
        a.link.send_kernel("shell", parts)
        await a.link.writer.drain()
        await a.link.close()  # the gateway goes away mid-cell
        (ws / "go").touch()
        await until_exists(ws / "printed")  # printed, with nobody listening
        b = await Conn.open(sock)
        got = await b.until_idle(mid)  # buffered while nobody listened
        assert ("iopub", "stream", {"name": "stdout", "text": "late\n"}) in got
        mid, parts = execute_parts("x + 1")
        b.link.send_kernel("shell", parts)
        got = await b.until_idle(mid)
        assert any(t == "execute_result" and c["data"]["text/plain"] == "42" for _, t, c in got)
        assert not [e for e in b.events if e.event == "dropped"]

    asyncio.run(main())


def test_a_reset_after_the_gateways_last_request_still_delivers_it():
    """A gateway closing with the agent's frames unread resets a unix socket;
    the request it wrote before that must still be read, then the stream ends
    (asyncio would raise the reset first: the reconnect test above lost its
    cell that way now and then)."""
    from sandgate_agent.transports import ResetIsEnd

    async def main():
        reader = asyncio.StreamReader(limit=P.MAX_PAYLOAD)
        proto = ResetIsEnd(reader)
        _, parts = execute_parts("1")
        proto.data_received(P.encode_kernel("shell", parts))
        proto.connection_lost(ConnectionResetError(104, "Connection reset by peer"))
        frame, payload = await P.read_frame(reader)
        assert frame.channel == "shell" and P.split_parts(frame, payload) == parts
        with pytest.raises(EOFError):
            await P.read_frame(reader)

    asyncio.run(main())


def test_an_answer_to_a_gateway_that_has_gone_never_answers_the_next_ones_request(agent):
    """The agent keeps what it says while no gateway is attached and says it
    to the next one, answers to the last gateway's requests included; the next
    gateway's request ids must not meet them (they once both began at 1, and
    the next gateway's command got the last one's output)."""
    sock, ws = agent

    async def main():
        a = await Conn.open(sock)
        old = asyncio.ensure_future(a.link.request("exec", {"argv": ["sh", "-c", "sleep 1; echo old"]}))
        await asyncio.sleep(0)  # the request is written ...
        await a.link.writer.drain()
        await a.link.close()  # ... and its gateway goes before the answer
        with pytest.raises(AgentError):
            await old
        b = await Conn.open(sock)
        # Asked while the old command still runs, answered after it ends.
        result, _ = await b.link.request("exec", {"argv": ["sh", "-c", "sleep 2.5; echo newer"]})
        assert result["stdout_len"] == len("newer\n"), result
        result, _ = await b.link.request("ping")
        assert "agent_version" in result, result

    asyncio.run(main())


def test_buffer_bound_reports_drops(agent):
    sock, ws = agent
    n = 1000  # display() sends one message per call; the bound is 50 frames

    async def main():
        a = await Conn.open(sock)
        mid, parts = execute_parts("import os, time\nfrom IPython.display import display\n"
                                   "while not os.path.exists('go'): time.sleep(0.05)\n"
                                   f"for i in range({n}):\n    display(i)\nopen('done', 'w').close()")
        a.link.send_kernel("shell", parts)
        while True:  # the cell has started; its output waits for `go`
            ch, p = await asyncio.wait_for(a.queue.get(), 30)
            if mid.encode() in p[1]:
                break
        await a.link.close()
        (ws / "go").touch()
        await until_exists(ws / "done")  # the cell has run, with nobody listening
        b = await Conn.open(sock)
        # What reached the agent with nobody attached: busy and execute_input unless `a` had them, the
        # displays, idle, and the reply (its own socket: anywhere after the first display). The first
        # 50 frames were kept, the next ones dropped and counted, and those that come after `b`
        # attached arrive live: `b` gets the first 50, then the tail, and exactly the count is missing.
        got = []

        async def receive():
            ch, parts = await asyncio.wait_for(b.queue.get(), 30)
            content = json.loads(parts[3])
            got.append((json.loads(parts[0])["msg_type"],
                        content.get("execution_state") or content.get("data", {}).get("text/plain")))

        def lead():  # the frames from before `go` that `a` did not take
            return len(list(itertools.takewhile(lambda k: k in (("status", "busy"), ("execute_input", None)), got)))

        await receive()  # the agent says what it dropped before it sends what it kept
        dropped = [e.data["frames"] for e in b.events if e.event == "dropped"]
        # `done` comes after n displays, the agent reads them as they are sent: it is far past 50.
        assert len(dropped) == 1 and dropped[0] > 0, b.events
        d = dropped[0]
        while len(got) + d < lead() + n + 2:
            await receive()
        replies = sum(k[0] == "execute_reply" for k in got)
        assert replies <= 1 and len(got) + d == lead() + n + 2
        iopub = got[:lead()] + [("display_data", str(i)) for i in range(n)] + [("status", "idle")]
        kept = sum(k[0] != "execute_reply" for k in got[:50])
        io_dropped = d - (1 - replies)  # the reply is one of the dropped frames when it is not here
        assert [k for k in got if k[0] != "execute_reply"] == iopub[:kept] + iopub[kept + io_dropped:]

    asyncio.run(main())


def test_reconnect_with_setup_makes_the_kernel_its_own_in_one_request(agent):
    """A fork's `reconnect` carries its `setup`: the reply says it was done, the
    kernel has the environment and a new session, and a request without it
    (a resume) does nothing of the sort."""
    sock, ws = agent

    async def main():
        a = await Conn.open(sock)
        ask = "import os; print(os.environ.get('SG_FORK'), get_ipython().kernel.session.session)"

        async def kernel_says():
            mid, parts = execute_parts(ask)
            a.link.send_kernel("shell", parts)
            got = await a.until_idle(mid)
            return [c["text"] for ch, t, c in got if t == "stream"][0].split()

        before = await kernel_says()
        info, _ = await a.link.request("reconnect", {"clock": time.time(), "entropy": os.urandom(32).hex()})
        assert "setup" not in info and info["language_info"]["name"] == "python"
        assert await kernel_says() == before
        info, _ = await a.link.request("reconnect", {"clock": time.time(), "entropy": os.urandom(32).hex(),
                                                     "setup": {"env": {"SG_FORK": "yes"}}})
        assert info["setup"] is True and info["language_info"]["name"] == "python"
        env, session = await kernel_says()
        assert env == "yes" and session != before[1]
        with pytest.raises(AgentError, match="validation error|Field required|field required"):
            await a.link.request("reconnect", {"setup": {"env": "not-a-dict"}})
        # A setup that fails is said apart from the restore: the reconnect itself answers.
        info, _ = await a.link.request("reconnect", {"clock": time.time(), "setup": {"env": {"SG_BAD": "a\0b"}}})
        assert info["setup"] is False and "null" in info["setup_error"] and info["language_info"]["name"] == "python"
        assert await kernel_says() == [env, session]  # the kernel still answers, unchanged

    asyncio.run(main())


def test_a_restored_kernel_whose_sockets_are_lost_gets_new_ones_and_the_setup_again():
    """After a restore the agent checks the kernel (kernel_info, 5 s) while the setup's cell runs. If
    the kernel's sockets did not survive, the setup sent on them is cancelled, the sockets are made
    anew and the setup is sent again on them; if the check itself is cancelled, so is the setup."""
    from sandgate_agent.agent import Agent

    async def main():
        agent = Agent.__new__(Agent)  # no kernel: its three steps are stood in for
        calls, setups, answers = [], [], []
        never = asyncio.Event()

        async def kernel_info(deadline=None):
            calls.append(("kernel_info", deadline))
            await asyncio.sleep(0)  # a request's round trip: the setup's task runs meanwhile
            answer = answers.pop(0)
            if isinstance(answer, BaseException):
                raise answer
            return answer

        async def setup(args):
            setups.append(asyncio.current_task())
            if len(setups) == 1:
                await never.wait()  # its cell went to the lost sockets: no answer comes

        agent.kernel_info, agent.setup = kernel_info, setup
        agent.connect_kernel = lambda: calls.append(("connect",))
        answers[:] = [RuntimeError("no kernel_info_reply"), {"status": "ok"}]
        info, task = await asyncio.wait_for(agent._restored_kernel({"env": {"A": "1"}}), 10)
        assert info == {"status": "ok"} and calls == [("kernel_info", 5), ("connect",), ("kernel_info", None)]
        await asyncio.wait_for(task, 10)
        assert len(setups) == 2 and setups[0].cancelled() and task is setups[1]

        calls.clear(), setups.clear()
        answers[:] = [{"status": "ok"}]
        info, task = await agent._restored_kernel(None)  # a resume: no setup
        assert info == {"status": "ok"} and task is None and calls == [("kernel_info", 5)] and not setups

        answers[:] = [asyncio.CancelledError()]
        with pytest.raises(asyncio.CancelledError):
            await agent._restored_kernel({"env": {}})
        await asyncio.gather(*setups, return_exceptions=True)
        assert len(setups) == 1 and setups[0].cancelled()

    asyncio.run(main())


def test_the_kernel_starts_without_debugpy_jedi_or_prompt_toolkit_and_each_still_works(agent):
    """ipykernel and IPython would import debugpy, jedi and prompt_toolkit at
    start (~10 MB of heap in every sandbox and checkpoint, none of it used by
    a kernel that only runs cells); the kernel leaves them out while
    ipykernel loads, and only then: a completion loads jedi and completes with
    it, a cell imports debugpy, IPython.embed and its terminal module."""
    sock, ws = agent

    async def main():
        a = await Conn.open(sock)

        async def run(code):
            mid, parts = execute_parts(code)
            a.link.send_kernel("shell", parts)
            got = await a.until_idle(mid)
            return "".join(c["text"] for ch, t, c in got if t == "stream")

        loaded = "import sys\nprint(sorted(m for m in sys.modules if m.split('.')[0] in {}))"
        heavy = "('debugpy', '_pydevd_bundle', 'jedi', 'parso', 'prompt_toolkit')"
        assert await run(loaded.format(heavy)) == "[]\n"

        code = "import collections\ncollections.Ordered"
        h = {"msg_id": uuid.uuid4().hex, "msg_type": "complete_request", "session": "t", "username": "t",
             "date": "2026-01-01T00:00:00Z", "version": "5.3"}
        a.link.send_kernel("shell", [json.dumps(h).encode(), b"{}", b"{}",
                                     json.dumps({"code": code, "cursor_pos": len(code)}).encode()])
        while True:
            ch, parts = await asyncio.wait_for(a.queue.get(), 60)
            if ch == "shell" and json.loads(parts[0])["msg_type"] == "complete_reply":
                reply = json.loads(parts[3])
                break
        assert reply["status"] == "ok" and "OrderedDict" in reply["matches"], reply
        assert await run("print('jedi' in sys.modules)") == "True\n"  # the completion loaded it

        # IPython.embed is the real function (it finds its caller by frame depth: no wrapper may sit
        # between), loaded at its first lookup, however it is looked up.
        assert await run("import debugpy, IPython\nprint(debugpy.__name__, 'prompt_toolkit' in sys.modules)\n"
                         "from IPython import embed\nimport IPython.terminal.embed as e\n"
                         "print(embed is IPython.embed is e.embed, e.InteractiveShellEmbed.__name__)\n"
                         "print(IPython.InteractiveShell.__name__)"
                         ) == "debugpy False\nTrue InteractiveShellEmbed\nInteractiveShell\n"

    asyncio.run(main())


def test_files_and_exec(agent):
    sock, ws = agent

    async def main():
        a = await Conn.open(sock)
        blob = bytes(range(256)) * 1000
        assert (await a.link.request("file_write", {"path": "d/e/blob.bin"}, blob))[0]["size"] == len(blob)
        assert (ws / "d/e/blob.bin").read_bytes() == blob
        _, data = await a.link.request("file_read", {"path": "d/e/blob.bin"})
        assert data == blob
        entries = (await a.link.request("file_list", {"path": "d/e"}))[0]["entries"]
        assert [(e["name"], e["type"], e["size"]) for e in entries] == [("blob.bin", "file", len(blob))]
        for bad in ("../outside", "/../../etc/passwd", "d/../../x"):
            with pytest.raises(AgentError, match="outside the workspace"):
                await a.link.request("file_read", {"path": bad})
        with pytest.raises(AgentError, match="FileNotFoundError"):
            await a.link.request("file_read", {"path": "missing.txt"})
        with pytest.raises(AgentError, match="refusing to delete the workspace"):
            await a.link.request("file_delete", {"path": ""})
        await a.link.request("file_delete", {"path": "d"})
        assert not (ws / "d").exists()
        res, out = await a.link.request("exec", {"argv": ["sh", "-c", "echo out; echo err >&2; exit 3"]})
        assert res["truncated"] is False
        assert res["exit_code"] == 3 and out[:res["stdout_len"]] == b"out\n" and out[res["stdout_len"]:] == b"err\n"
        res, _ = await a.link.request("exec", {"argv": ["sleep", "30"], "timeout": 0.5})
        assert res["timed_out"] is True
        with pytest.raises(AgentError, match="unknown op"):
            await a.link.request("format_disk")
        with pytest.raises(AgentError, match="validation error|field required|Field required"):
            await a.link.request("exec", {"argv": "not-a-list"})
        info, _ = await a.link.request("ping")
        assert info["kernel_alive"] and info["kernel_responding"]

    asyncio.run(main())


def test_garbage_on_the_stream_drops_only_that_connection(agent):
    sock, _ = agent

    async def main():
        reader, writer = await asyncio.open_unix_connection(sock)
        await P.read_frame(reader)  # ready
        writer.write(P.PREFIX.pack(5, 0) + b"notjs")
        await writer.drain()
        await asyncio.wait_for(reader.read(), 10)  # returns at EOF: the agent hung up on garbage
        assert reader.at_eof()
        a = await Conn.open(sock)  # and serves the next connection
        mid, parts = execute_parts("'alive'")
        a.link.send_kernel("shell", parts)
        got = await a.until_idle(mid)
        assert any(t == "execute_result" for _, t, _ in got)

    asyncio.run(main())


def test_frame_codec():
    frame = P.encode_kernel("iopub", [b"{}", b"{}", b"{}", b'{"a":1}', b"\x00\xff"])

    async def main():
        reader = asyncio.StreamReader()
        reader.feed_data(frame + P.encode(P.EventFrame(event="ready")))
        reader.feed_eof()
        f, payload = await P.read_frame(reader)
        assert f.channel == "iopub" and P.split_parts(f, payload)[4] == b"\x00\xff"
        f, _ = await P.read_frame(reader)
        assert f.event == "ready"
        with pytest.raises(EOFError):
            await P.read_frame(reader)

    asyncio.run(main())
    for bad in (b'{"type":"nope"}', b"[]", b"{", b'{"type":"kernel","channel":"bogus","parts":[]}'):
        with pytest.raises(P.ProtocolError):
            P.parse_header(bad)
    with pytest.raises(P.ProtocolError, match="too large"):
        P.encode(P.EventFrame(event="ready"), b"x" * (P.MAX_PAYLOAD + 1))

    async def oversized():
        r = asyncio.StreamReader()
        r.feed_data(P.PREFIX.pack(P.MAX_HEADER + 1, 0))
        await P.read_frame(r)

    with pytest.raises(P.ProtocolError, match="too large"):
        asyncio.run(oversized())


def test_trace_spans_across_gateway_and_agent(agent, monkeypatch, caplog):
    """SANDGATE_TRACE: a traced request makes the agent stamp it and every
    message answering it; the gateway logs one line per message with every
    hop in order. Untraced frames carry no trace field at all."""
    from sandgate import trace

    sock, _ = agent
    assert "trace" not in P.encode_kernel("shell", [b"{}"] * 4).decode(errors="replace")
    monkeypatch.setattr(trace, "ENABLED", True)
    caplog.set_level("INFO", logger="sandgate.trace")

    async def main():
        a = await Conn.open(sock)
        mid, parts = execute_parts("1+1")
        trace.ws_received(json.loads(parts[0]))
        a.link.send_kernel("shell", parts)
        await a.until_done(mid)
        return mid

    mid = asyncio.run(main())
    lines = [json.loads(r.getMessage().split(" ", 1)[1]) for r in caplog.records if r.name == "sandgate.trace"]
    types = {line["msg_type"] for line in lines}
    assert {"status:busy", "execute_input", "execute_result", "execute_reply", "status:idle"} <= types, types
    assert all(line["parent"] == mid for line in lines)
    hops = ("gw_ws_in", "gw_out", "ag_in", "ag_zmq", "ag_recv", "ag_out", "gw_in", "gw_sent")
    for line in lines:
        assert all(h in line for h in hops), line
        assert [line[h] for h in hops] == sorted(line[h] for h in hops), line  # causal order, one clock here
        assert line["k"] >= line["ag_zmq"] or line["msg_type"] != "status:busy"
    assert trace.summarize(f"x trace {json.dumps(line)}" for line in lines)["execute_reply"]["n"] == 1


def test_kernel_flush_and_reply_settings(agent):
    """The kernel's cut per-cell costs (sandgate_agent/kernel.py) keep output
    whole: what a cell prints, with or without a newline or a flush, and what
    a thread prints while the cell waits, arrives before its idle status; no
    sleep before the reply; history in memory, In and _i still there."""
    sock, _ = agent

    async def main():
        a = await Conn.open(sock)
        mid, parts = execute_parts("pass")  # past the kernel's start-up output
        a.link.send_kernel("shell", parts)
        await a.until_idle(mid)
        mid, parts = execute_parts(
            "import sys, threading\nprint('a', end='')\nsys.stdout.flush()\nprint('b', end='')\n"
            "t = threading.Thread(target=lambda: print('c'))\nt.start(); t.join()\n"
            "sys.stderr.write('e')\n(get_ipython().kernel._execute_sleep, str(get_ipython().history_manager.hist_file),"
            " len(In) > 2, _i)")
        a.link.send_kernel("shell", parts)
        return await a.until_idle(mid)

    got = asyncio.run(main())
    out = "".join(c["text"] for _, t, c in got if t == "stream" and c["name"] == "stdout")
    err = "".join(c["text"] for _, t, c in got if t == "stream" and c["name"] == "stderr")
    assert out == "abc\n" and err == "e"
    assert any(t == "execute_result" and c["data"]["text/plain"] == "(0.0, ':memory:', True, 'pass')"
               for _, t, c in got), got


def test_iopub_order_with_direct_sends(agent):
    """The kernel's main thread sends IOPub messages itself when the IOPub
    thread has nothing queued (sandgate_agent/kernel.py): the order on IOPub
    is still the order they were made in, printed output (which goes through
    the IOPub thread) included, and with a user's thread publishing too."""
    sock, _ = agent
    code = ("import threading\nfrom IPython.display import display\n"
            "t = threading.Thread(target=lambda: [display(f't{i}') for i in range(30)])\nt.start()\n"
            "for i in range(30):\n    print(f'p{i}')\n    display(f'd{i}')\n"
            "t.join()\nfrom ipykernel.iostream import IOPubThread\nIOPubThread.send_multipart.__qualname__")

    async def main():
        a = await Conn.open(sock)
        mid, parts = execute_parts("pass")  # past the kernel's start-up output
        a.link.send_kernel("shell", parts)
        await a.until_idle(mid)
        mid, parts = execute_parts(code)
        a.link.send_kernel("shell", parts)
        return await a.until_idle(mid)

    got = [(t, c) for ch, t, c in asyncio.run(main()) if ch == "iopub"]
    types = [t for t, _ in got]
    start = types.index("execute_input")
    assert types[start - 1] == "status" and got[start - 1][1]["execution_state"] == "busy"
    assert types[-2:] == ["execute_result", "status"] and got[-1][1]["execution_state"] == "idle"
    assert "_direct_iopub" in got[-2][1]["data"]["text/plain"]  # the patch is in effect
    shown = [c["data"]["text/plain"].strip("'") for t, c in got if t == "display_data"]
    assert [x for x in shown if x[0] == "d"] == [f"d{i}" for i in range(30)]
    assert [x for x in shown if x[0] == "t"] == [f"t{i}" for i in range(30)]
    # display() flushes stdout first: each print comes out just before its display.
    # A print writes its text and its newline apart, and the IOPub thread's flush
    # timer may fall between them (a loaded host): adjacent stream messages are joined.
    main = []
    for t, c in got:
        if t == "stream" and c["name"] == "stdout":
            if main and main[-1][0] == "stream":
                main[-1] = ("stream", main[-1][1] + c["text"])
            else:
                main.append(("stream", c["text"]))
        elif t == "display_data" and c["data"]["text/plain"].startswith("'d"):
            main.append(("display", c["data"]["text/plain"]))
    assert [x.strip().strip("'") for _, x in main] == [x for i in range(30) for x in (f"p{i}", f"d{i}")]


def test_a_child_forked_while_iopub_is_locked_gets_a_free_lock(agent):
    """The IOPub send lock (sandgate_agent/kernel.py's ``_direct_iopub``) held at a fork stays held
    in the child forever unless replaced there: the child gets a free one (os.register_at_fork), and
    the parent's kernel goes on answering."""
    sock, _ = agent
    code = ("import os\nfrom ipykernel.iostream import IOPubThread\n"
            "cells = IOPubThread._really_send.__closure__\n"
            "state = next(c.cell_contents for c in cells if isinstance(c.cell_contents, dict))\n"
            "with state['lock']:\n"
            "    pid = os.fork()\n"
            "    if pid == 0:\n"
            "        os._exit(0 if not state['lock'].locked() else 3)\n"
            "os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])")

    async def main():
        a = await Conn.open(sock)
        mid, parts = execute_parts(code)
        a.link.send_kernel("shell", parts)
        got = await a.until_idle(mid)
        mid, parts = execute_parts("'still answering'")
        a.link.send_kernel("shell", parts)
        return got, await a.until_idle(mid)

    forked, after = asyncio.run(main())
    results = [c["data"]["text/plain"] for _, t, c in forked if t == "execute_result"]
    assert results == ["0"], forked  # 3: the child found the lock held
    assert any(t == "execute_result" and c["data"]["text/plain"] == "'still answering'" for _, t, c in after)
