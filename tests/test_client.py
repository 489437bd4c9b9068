"""The Python SDK (client/, import name sandgate_client) against a real
`sandgate serve` with runsc sandboxes: sync and asyncio, typed results and errors,
files, checkpoints, forks, pause/resume, timeouts, the kernel websocket (the typed
errors of refusals are unit/test_client_errors.py's)."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from conftest import Gateway, wait_for
from sandgate_client import AuthError, BadRequest, Conflict, NotFound, Sandbox, SandboxDied, Timeout, Unavailable


@pytest.fixture(scope="module")
def gw(home, tmp_path_factory):
    g = Gateway(home, tmp_path_factory.mktemp("gw"), env={"SANDGATE_MAX_KERNELS": "6"})
    yield g
    g.stop()


@pytest.fixture
def sb(gw):
    with Sandbox.create(gw.url, gw.token, timeout=120) as s:
        yield s


def live_ids(gw) -> set:
    return {s.id for s in Sandbox.list(gw.url, gw.token)}


def test_run_code_streams_and_types_its_results(gw):
    seen = {"stdout": [], "stderr": [], "results": [], "order": []}
    with Sandbox.create(gw.url, gw.token, labels={"test": "client"}) as sb:
        assert sb.info.state == "running" and sb.info.labels == {"test": "client"}
        assert sb.id in live_ids(gw)
        ex = sb.run_code(
            "import sys\nfrom IPython.display import display, HTML\n"
            "print('hello')\nprint('oops', file=sys.stderr)\ndisplay(HTML('<b>bold</b>'))\n40 + 2",
            on_stdout=lambda t: (seen["stdout"].append(t), seen["order"].append("stdout")),
            on_stderr=lambda t: (seen["stderr"].append(t), seen["order"].append("stderr")),
            on_result=lambda r: (seen["results"].append(r), seen["order"].append("result")))
        assert ex.status == "ok" and ex.error is None
        assert ex.text == "42" and ex.stdout == "hello\n" and ex.stderr == "oops\n"
        assert "".join(seen["stdout"]) == "hello\n" and "".join(seen["stderr"]) == "oops\n"
        html, main = ex.results
        assert html.html == "<b>bold</b>" and not html.is_main_result and main.is_main_result
        assert [r.data for r in seen["results"]] == [html.data, main.data]
        assert seen["order"].index("stdout") < seen["order"].index("result")
        count = ex.execution_count
        assert isinstance(count, int)

        err = sb.run_code("def f():\n    return 1 / 0\nf()")
        assert err.status == "error" and err.error.ename == "ZeroDivisionError"
        assert "division by zero" in err.error.evalue and "return 1 / 0" in err.error.traceback_text
        assert err.execution_count == count + 1

        png = sb.run_code("import matplotlib\nmatplotlib.use('Agg')\nimport matplotlib.pyplot as plt\n"
                          "%matplotlib inline\nplt.plot([1, 2, 3]); plt.show()", timeout=120)
        assert png.status == "ok" and png.error is None, (png.status, png.error)  # not "aborted" after the error
        assert any(r.png_bytes and r.png_bytes.startswith(b"\x89PNG") for r in png.results), str(png.outputs)[:2000]
        sid = sb.id
    # The context manager deleted it.
    assert sid not in live_ids(gw)
    with pytest.raises(NotFound) as e:
        Sandbox.connect(sid, gw.url, gw.token)
    assert e.value.status == 404 and e.value.code == "not_found" and sid in e.value.message


def test_files(sb):
    sb.files.write("data/notes.txt", "first line\n")
    sb.files.write("data/blob.bin", bytes(range(256)))
    assert sb.files.read("data/notes.txt") == b"first line\n"
    assert sb.files.read("data/blob.bin") == bytes(range(256))
    entries = {e.name: e for e in sb.files.list("data")}
    assert set(entries) == {"notes.txt", "blob.bin"}
    assert entries["blob.bin"].size == 256 and entries["blob.bin"].type == "file"
    assert entries["notes.txt"].path == "data/notes.txt"
    assert any(e.name == "data" and e.is_dir for e in sb.files.list())
    # The kernel sees the same workspace.
    assert sb.run_code("open('data/notes.txt').read()").text == "'first line\\n'"
    sb.run_code("open('made_by_code.txt', 'w').write('from the kernel')")
    assert sb.files.read_text("made_by_code.txt") == "from the kernel"
    sb.files.remove("data/notes.txt")
    assert [e.name for e in sb.files.list("data")] == ["blob.bin"]
    assert not sb.files.exists("data/notes.txt") and sb.files.exists("data/blob.bin")
    with pytest.raises(NotFound):
        sb.files.read("data/notes.txt")
    with pytest.raises(BadRequest) as e:
        sb.files.read("data")
    assert e.value.code == "IsADirectoryError"
    with pytest.raises(BadRequest) as e:
        sb.files.list("data/blob.bin")
    assert e.value.code == "NotADirectoryError"


def test_checkpoint_fork_restore_pause_resume(gw, sb):
    sb.run_code("x = 41")
    cp = sb.checkpoint("before")
    assert cp.sandbox == sb.id and cp.name == "before"
    assert [c.id for c in sb.checkpoints()] == [cp.id]
    sb.run_code("x = 100")
    with sb.fork(cp.id) as child:  # from the checkpoint: x is 41 there
        assert child.id != sb.id and child.info.parent["sandbox"] == sb.id
        assert child.run_code("x + 1").text == "42"
    with sb.fork() as now:  # from now
        assert now.run_code("x").text == "100"
    with Sandbox.restore(cp.id, gw.url, gw.token) as restored:
        assert restored.run_code("x").text == "41"
        assert restored.info.parent["checkpoint"] == cp.id
    info = sb.pause()
    assert info.state == "paused" and info.pause_mode == "disk"
    assert sb.refresh().state == "paused"
    assert sb.resume().state == "running"
    assert sb.run_code("x").text == "100"
    assert sb.pause(mode="memory").state == "frozen"
    # Running code in a frozen sandbox wakes it.
    assert sb.run_code("x * 2").text == "200"
    assert sb.refresh().state == "running"


def test_egress_and_secrets_pass_through(gw):
    with Sandbox.create(gw.url, gw.token, egress={"allow": ["api.example.com:443"]},
                        secrets=[{"host": "api.example.com", "header": "Authorization", "value": "Bearer s3cret",
                                  "name": "EXAMPLE_KEY"}]) as sb:
        assert sb.info.egress == {"allow": ["api.example.com:443"], "deny": []}
        assert sb.info.raw["secrets"] == [{"host": "api.example.com", "header": "Authorization",
                                          "name": "EXAMPLE_KEY"}]
        # Inside, the variable holds a placeholder, never the value.
        val = sb.run_code("import os; os.environ['EXAMPLE_KEY']").text
        assert val and "s3cret" not in val
        assert sb.set_egress(allow=["*.example.org"]).egress == {"allow": ["*.example.org"], "deny": []}
    # A secret without egress is refused with the server's reason.
    with pytest.raises(BadRequest) as e:
        Sandbox.create(gw.url, gw.token, secrets=[{"host": "a.example", "header": "X", "value": "v"}])
    assert e.value.status == 400 and "v" != e.value.message


def test_a_sandbox_that_dies_raises_sandbox_died_then_conflict(gw):
    with Sandbox.create(gw.url, gw.token, limits={"memory_mb": 200}) as sb:
        sb.files.write("kept.txt", "kept")
        with pytest.raises(SandboxDied) as e:
            sb.run_code("x = bytearray(400 * 1024 * 1024)\nx[::4096] = b'1' * len(x[::4096])", timeout=120)
        # Either the cell's DeadKernelError or the execute stream's 409: both are SandboxDied.
        assert e.value.execution is not None and "killed" in str(e.value)
        assert wait_for(lambda: sb.refresh().state == "dead")
        assert sb.info.reason
        with pytest.raises(SandboxDied) as e:
            sb.files.read("kept.txt")
        assert isinstance(e.value, Conflict) and e.value.status == 409 and e.value.state == "dead"
        with pytest.raises(SandboxDied):
            sb.run_code("1")


def test_timeouts(sb):
    # A cell past its timeout: interrupted by the gateway, Timeout raised with the output so far.
    started = time.monotonic()
    with pytest.raises(Timeout) as e:
        sb.run_code("import time\nprint('started', flush=True)\ntime.sleep(60)", timeout=2)
    assert time.monotonic() - started < 30
    assert e.value.execution.status == "timeout" and e.value.execution.stdout == "started\n"
    # The sandbox carries on.
    assert sb.run_code("'still here'").text == "'still here'"
    # A server that accepts and never answers: the call's own timeout.
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        url = f"http://127.0.0.1:{srv.getsockname()[1]}"
        started = time.monotonic()
        with pytest.raises(Timeout):
            Sandbox.list(url, "t", timeout=1)
        with pytest.raises(Timeout):
            Sandbox.create(url, "t", timeout=1)
        assert time.monotonic() - started < 10


def test_kernel_websocket_execute_and_reconnect_with_replay(sb):
    with sb.kernel() as k:
        out = []
        ex = k.execute("print('ws'); 6 * 7", on_stdout=out.append)
        assert ex.text == "42" and ex.stdout == "ws\n" and out == ["ws\n"]
        err = k.execute("raise ValueError('bad')")
        assert err.status == "error" and err.error.ename == "ValueError" and err.error.evalue == "bad"
        # The connection drops while a cell runs; its output, buffered by the
        # gateway meanwhile, is replayed on the reconnect.
        msg_id = k.send("execute_request", {"code": "import time\ntime.sleep(3)\nprint('after the drop')\n'done'",
                                            "silent": False, "store_history": True, "user_expressions": {},
                                            "allow_stdin": False})
        k.drop()
        ex = k.wait(msg_id, timeout=60)
        assert k.reconnects >= 1
        assert ex.stdout == "after the drop\n" and ex.text == "'done'"
        with pytest.raises(Timeout) as e:
            k.execute("import time; time.sleep(60)", timeout=2)
        assert e.value.execution.status == "timeout"
        assert k.execute("'after'", timeout=60).text == "'after'"


def test_kernel_websocket_v1_sessions_raw_messages_and_input(sb):
    from sandgate_client.kernel import V1

    with pytest.raises(ValueError, match="protocol must be one of"):
        sb.kernel(protocol="v2")
    seen = []
    with sb.kernel(session="sdk-alpha") as a, sb.kernel(protocol="v1", session="sdk-beta", on_message=seen.append) as b:
        assert b.ws.subprotocol == V1 and a.ws.subprotocol is None
        assert (a.session, b.session) == ("sdk-alpha", "sdk-beta")
        ex = a.execute("import sys; print('out'); sys.stdout.flush(); 1 + 1")
        assert ex.text == "2" and ex.reply["status"] == "ok" and ex.reply["execution_count"] == ex.execution_count
        kinds = [m["msg_type"] for m in ex.messages]
        assert kinds[0] == "status" and {"execute_input", "stream", "execute_result", "execute_reply"} <= set(kinds)
        assert all(m["parent_header"]["session"] == "sdk-alpha" for m in ex.messages)
        # The v1 connection, in its binary frames: its own request, with stdin answered by on_input.
        prompts = []
        ex = b.execute("name = input('who? ')\nprint('hello', name)",
                       on_input=lambda prompt, password: prompts.append((prompt, password)) or "sandgate")
        assert ex.stdout == "hello sandgate\n" and prompts == [("who? ", False)]
        assert any(m["channel"] == "stdin" and m["msg_type"] == "input_request" for m in ex.messages)
        assert all(isinstance(m["buffers"], list) for m in seen)
        # iopub reaches both connections; alpha's execute_reply went to alpha's session only.
        alpha = [m for m in seen if m["parent_header"].get("session") == "sdk-alpha"]
        ex_a_id = alpha[0]["parent_header"]["msg_id"]
        assert any(m["msg_type"] == "execute_result" for m in alpha)
        assert not any(m["msg_type"] == "execute_reply" and m["parent_header"]["msg_id"] == ex_a_id for m in seen)
        # Without on_input, input() fails in the kernel rather than waiting for an answer.
        ex = a.execute("input('nobody answers')")
        assert ex.status == "error" and ex.error.ename == "StdinNotImplementedError"


# -- asyncio ------------------------------------------------------------------------
def test_async_sandbox(gw):
    from sandgate_client import AsyncSandbox

    async def main():
        chunks, results = [], []

        async def on_result(r):  # a coroutine callback is awaited
            await asyncio.sleep(0)
            results.append(r)

        async with AsyncSandbox.create(gw.url, gw.token, labels={"test": "async"}) as sb:
            assert sb.info.state == "running"
            ex = await sb.run_code("print('a'); print('b', flush=True); {'k': 1}", on_stdout=chunks.append,
                                   on_result=on_result)
            assert ex.text == "{'k': 1}" and ex.stdout == "a\nb\n" and "".join(chunks) == "a\nb\n"
            assert [r.text for r in results] == ["{'k': 1}"]
            err = await sb.run_code("undefined_name")
            assert err.error.ename == "NameError" and err.status == "error"

            await sb.files.write("x/y.txt", b"async bytes")
            assert await sb.files.read("x/y.txt") == b"async bytes"
            assert [e.name for e in await sb.files.list("x")] == ["y.txt"]
            await sb.files.remove("x/y.txt")
            with pytest.raises(NotFound):
                await sb.files.read("x/y.txt")

            await sb.run_code("n = 7")
            cp = await sb.checkpoint("async")
            async with await sb.fork(cp.id) as child:
                assert (await child.run_code("n * 6")).text == "42"
            assert (await sb.pause()).state == "paused"
            assert (await sb.resume()).state == "running"
            assert (await sb.run_code("n")).text == "7"

            with pytest.raises(Timeout) as e:
                await sb.run_code("import time; time.sleep(60)", timeout=1)
            assert e.value.execution.status == "timeout"

            k = await sb.kernel()
            async with k:
                out = await k.execute("print('over ws'); 2 ** 10")
                assert out.stdout == "over ws\n" and out.text == "1024"
                msg_id = await k.send("execute_request", {
                    "code": "import time\ntime.sleep(3)\nprint('replayed')", "silent": False, "store_history": True,
                    "user_expressions": {}, "allow_stdin": False})
                k.drop()
                ex = await k.wait(msg_id, timeout=60)
                assert k.reconnects >= 1 and ex.stdout == "replayed\n"
                with pytest.raises(Timeout) as e:
                    await k.execute("import time; time.sleep(60)", timeout=2)
                assert e.value.execution.status == "timeout"
                # The interrupted cell ended before Timeout was raised: the next one is not aborted.
                assert (await k.execute("'after'")).text == "'after'"
            seen = []
            async with await sb.kernel(protocol="v1", session="async-v1", on_message=seen.append) as v:
                assert v.ws.selected_subprotocol == "v1.kernel.websocket.jupyter.org"

                async def answer(prompt, password):  # a coroutine on_input is awaited
                    return "async " + prompt

                ex = await v.execute("print(input('x'))", on_input=answer)
                assert ex.stdout == "async x\n" and ex.reply["status"] == "ok"
                assert [m["msg_type"] for m in ex.messages][-1] in ("status", "execute_reply")
                assert all(m["parent_header"]["session"] == "async-v1" for m in ex.messages) and seen
            sid = sb.id
            assert sid in {s.id for s in await AsyncSandbox.list(gw.url, gw.token)}
        with pytest.raises(NotFound):
            await AsyncSandbox.connect(sid, gw.url, gw.token)
        with pytest.raises(AuthError):
            await AsyncSandbox.list(gw.url, "bad")
        sb2 = await AsyncSandbox.create(gw.url, gw.token)
        await sb2.delete()
        with pytest.raises(NotFound):
            await sb2.refresh()

    asyncio.run(main())


def test_async_errors_and_timeouts(gw):
    from sandgate_client import AsyncSandbox

    async def main():
        with socket.socket() as srv:
            srv.bind(("127.0.0.1", 0))
            srv.listen()
            url = f"http://127.0.0.1:{srv.getsockname()[1]}"
            started = time.monotonic()
            with pytest.raises(Timeout):
                await AsyncSandbox.list(url, "t", timeout=1)
            assert time.monotonic() - started < 10
        with pytest.raises(Unavailable):
            await AsyncSandbox.list(url, "t", timeout=5)  # closed now: nothing listens
        with pytest.raises(BadRequest):
            await AsyncSandbox.create(gw.url, gw.token, driver="nope")

    asyncio.run(main())
