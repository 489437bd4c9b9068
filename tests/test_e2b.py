"""The E2B-compatible API (/e2b) driven by the unmodified `e2b` and
`e2b-code-interpreter` SDKs from PyPI against a real `sandgate serve` with
runsc sandboxes: E2B_API_URL and E2B_SANDBOX_URL are the gateway's /e2b,
E2B_API_KEY a Sandgate token, and E2B_DOMAIN a name that resolves nowhere,
so nothing can reach e2b's cloud. docs/e2b.md lists what is covered; auth,
scoping, refusals and bad input are unit/test_e2b_api.py's."""

from __future__ import annotations

import asyncio
import base64
import io
import struct
import time
import zlib

import pytest

import e2b  # the test extra installs both SDKs: a missing one fails the module, it is never skipped
from e2b_code_interpreter import AsyncSandbox, Sandbox

from conftest import ANSI, Gateway, environment
from sandgate.api.e2b import e2b_api_key


def sdk_pointed_at(g):
    """The SDKs' environment naming gateway ``g``, for as long as the block runs."""
    return environment({"E2B_API_URL": g.url + "/e2b", "E2B_SANDBOX_URL": g.url + "/e2b",
                        "E2B_API_KEY": e2b_api_key(g.token), "E2B_DOMAIN": "sandgate.invalid", "E2B_DEBUG": None})


@pytest.fixture(scope="module")
def gw(home, tmp_path_factory):
    g = Gateway(home, tmp_path_factory.mktemp("e2b"), env={"SANDGATE_TENANT_CREATE_RATE": "0"})
    with sdk_pointed_at(g):
        yield g
    g.stop()


@pytest.fixture
def sb(gw):
    s = Sandbox.create()
    yield s
    Sandbox.kill(s.sandbox_id)  # False when the test killed it already


def png_pixels(png: bytes):
    """(width, height, rows of RGBA tuples) of an 8-bit RGB/RGBA PNG, standard library only."""
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width = 8, b"", 0
    while pos < len(png):
        n, kind = struct.unpack(">I4s", png[pos:pos + 8])
        chunk = png[pos + 8:pos + 8 + n]
        if kind == b"IHDR":
            width, height, depth, color = struct.unpack(">IIBB", chunk[:10])
            assert depth == 8 and color in (2, 6), (depth, color)
            bpp = 4 if color == 6 else 3
        elif kind == b"IDAT":
            idat += chunk
        pos += 12 + n
    data, stride, rows, prev = zlib.decompress(idat), width * bpp, [], bytearray(width * bpp)
    for y in range(height):
        f, line = data[y * (stride + 1)], bytearray(data[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            p = a + b - c
            pr = a if abs(p - a) <= abs(p - b) and abs(p - a) <= abs(p - c) else b if abs(p - b) <= abs(p - c) else c
            line[i] = (line[i] + (0, a, b, (a + b) // 2, pr)[f]) & 0xFF
        rows.append([tuple(line[i:i + bpp]) for i in range(0, stride, bpp)])
        prev = line
    return width, height, rows


# -- the code interpreter -------------------------------------------------------------
def test_create_run_code_and_kill(gw):
    s = Sandbox.create(metadata={"suite": "e2b"})
    assert s.sandbox_id
    ex = s.run_code("1+1")
    assert ex.text == "2" and ex.error is None
    assert [r.is_main_result for r in ex.results] == [True]
    assert isinstance(ex.execution_count, int) and ex.execution_count >= 1
    ex = s.run_code("import sys\nprint('to stdout')\nprint('to stderr', file=sys.stderr)")
    assert ex.logs.stdout == ["to stdout\n"] and ex.logs.stderr == ["to stderr\n"]
    ex = s.run_code("import os; os.getcwd()")
    assert ex.text == "'/workspace'"  # relative paths resolve in the kernel's working directory
    assert s.is_running()
    s.kill()
    with pytest.raises(e2b.NotFoundException):
        Sandbox.get_info(s.sandbox_id)
    assert Sandbox.kill(s.sandbox_id) is False  # E2B's answer for a sandbox that is gone
    with pytest.raises(e2b.NotFoundException):
        s.run_code("1")


def test_error_has_name_value_and_traceback(sb):
    seen = []
    ex = sb.run_code("def f():\n    return 1/0\nf()", on_error=seen.append)
    assert ex.error is not None and seen == [ex.error]
    assert ex.error.name == "ZeroDivisionError" and ex.error.value == "division by zero"
    tb = ANSI.sub("", ex.error.traceback)  # IPython's colours, as E2B sends them
    assert "ZeroDivisionError" in tb and "return" in tb and "f()" in tb, tb
    assert ex.results == []
    assert sb.run_code("'still alive'").text == "'still alive'"


def test_a_cell_whose_kernel_dies_has_an_error(sb):
    """The error is in the kernel's reply only (no iopub error message): it still reaches E2B's SDK."""
    seen = []
    ex = sb.run_code("import os\nos._exit(3)", on_error=seen.append)
    assert ex.error is not None and seen == [ex.error]
    assert ex.error.name == "DeadKernelError" and "status 3" in ex.error.value, ex.error
    assert sb.run_code("1 + 1").text == "2"  # on the restarted kernel


def test_matplotlib_figure_is_a_png(sb):
    assert sb.run_code("import matplotlib").error is None, "matplotlib is in the sandbox image"
    ex = sb.run_code("%config InlineBackend.print_figure_kwargs = {'bbox_inches': None}\n"  # the whole figure
                     "import matplotlib.pyplot as plt\n"
                     "fig, ax = plt.subplots(figsize=(2, 2), dpi=50)\n"
                     "fig.patch.set_facecolor((1, 0, 0)); ax.set_facecolor((0, 0, 1)); ax.set_xticks([]); ax.set_yticks([])\n"
                     "plt.show()")
    assert ex.error is None
    (res,) = [r for r in ex.results if r.png]
    assert not res.is_main_result and res.text.startswith("<Figure")
    w, h, rows = png_pixels(base64.b64decode(res.png))
    assert (w, h) == (100, 100)
    assert rows[2][2][:3] == (255, 0, 0)  # the figure's red border
    assert rows[h // 2][w // 2][:3] == (0, 0, 255)  # the blue axes in the middle


def test_every_mime_format(sb):
    ex = sb.run_code(
        "from IPython.display import display, HTML, Markdown, SVG, Latex, JSON, Javascript\n"
        "display(HTML('<b>bold</b>'))\n"
        "display(Markdown('# title'))\n"
        "display(SVG('<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"1\" height=\"1\"/>'))\n"
        "display(Latex('$x^2$'))\n"
        "display(JSON({'a': [1, 2]}))\n"
        "display(Javascript('console.log(1)'))\n"
        "display({'application/x-sandgate': 'custom', 'text/plain': 'plain'}, raw=True)\n"
        "class Both:\n"
        "    def _repr_html_(self): return '<i>main</i>'\n"
        "    def __repr__(self): return 'Both()'\n"
        "Both()")
    assert ex.error is None
    html, md, svg, latex, js_json, js, custom, main = ex.results
    assert html.html == "<b>bold</b>" and md.markdown == "# title" and "<svg" in svg.svg
    assert latex.latex == "$x^2$" and js_json.json == {"a": [1, 2]} and js.javascript == "console.log(1)"
    assert custom.extra == {"application/x-sandgate": "custom"} and custom.text == "plain"
    assert [r.is_main_result for r in ex.results] == [False] * 7 + [True]
    assert main.text == "Both()" and main.html == "<i>main</i>" and set(main.formats()) == {"text", "html"}


def test_output_streams_while_the_cell_runs(sb):
    # The cell waits for a file that only the on_stdout callback writes: it
    # ends only if its first line reached the client while it ran.
    seen = []

    def on_stdout(msg):
        seen.append(msg.line)
        if msg.line == "first\n":
            sb.files.write("go", "1")

    ex = sb.run_code("import os, time\nprint('first', flush=True)\ndeadline = time.time() + 60\n"
                     "while not os.path.exists('go') and time.time() < deadline:\n    time.sleep(0.02)\n"
                     "print('released' if os.path.exists('go') else 'never released')", on_stdout=on_stdout,
                     timeout=90)
    assert seen == ["first\n", "released\n"], seen
    assert ex.logs.stdout == seen and ex.error is None


def test_contexts(sb):
    (ctx,) = sb.list_code_contexts()
    assert (ctx.id, ctx.language, ctx.cwd) == ("python", "python", "/workspace")
    sb.run_code("kept = 1")
    assert sb.run_code("kept", context=ctx).text == "1"
    with pytest.raises(e2b.SandboxException, match="one code context"):
        sb.create_code_context()
    sb.restart_code_context(ctx)  # the kernel restarts: its state is gone
    assert sb.run_code("'kept' in globals()").text == "False"
    with pytest.raises(e2b.SandboxException, match="Python only"):
        sb.run_code("1", language="r")


# -- files ------------------------------------------------------------------------------
def test_files_write_read_list(sb):
    info = sb.files.write("notes.txt", "hello from e2b")  # multipart/form-data
    assert (info.name, info.path) == ("notes.txt", "/workspace/notes.txt")
    assert sb.files.read("notes.txt") == "hello from e2b"
    assert sb.files.read("/workspace/notes.txt") == "hello from e2b"
    assert sb.run_code("open('notes.txt').read()").text == "'hello from e2b'"  # the kernel's cwd
    blob = bytes(range(256)) * 64
    sb.files.write("data/blob.bin", io.BytesIO(blob))  # a file object: application/octet-stream
    assert bytes(sb.files.read("data/blob.bin", format="bytes")) == blob
    sb.files.write("data/zipped.txt", "compressed on the way", gzip=True)  # octet-stream, Content-Encoding gzip
    assert sb.files.read("data/zipped.txt") == "compressed on the way"
    written = sb.files.write_files([{"path": "a.txt", "data": "A"}, {"path": "/workspace/data/b.txt", "data": b"B"}])
    assert [w.path for w in written] == ["/workspace/a.txt", "/workspace/data/b.txt"]
    top = {e.name: e for e in sb.files.list(".")}
    assert set(top) == {"notes.txt", "data", "a.txt"}
    assert top["data"].type == e2b.FileType.DIR and top["notes.txt"].type == e2b.FileType.FILE
    assert top["notes.txt"].size == len("hello from e2b")
    deep = [e.path for e in sb.files.list("/workspace", depth=2)]
    assert {"/workspace/data/blob.bin", "/workspace/data/b.txt", "/workspace/data/zipped.txt"} <= set(deep)
    assert sb.files.exists("a.txt") and not sb.files.exists("missing.txt")
    assert sb.files.get_info("data").type == e2b.FileType.DIR
    sb.files.remove("a.txt")
    assert not sb.files.exists("a.txt")
    with pytest.raises(e2b.FileNotFoundException):
        sb.files.read("missing.txt")
    with pytest.raises(e2b.SandboxException, match="only /workspace"):
        sb.files.read("/etc/passwd")


# -- lifecycle --------------------------------------------------------------------------------
def test_timeout_info_and_list(gw, sb):
    info = sb.get_info()
    assert info.state == e2b.SandboxState.RUNNING and info.envd_version >= "0.4.0"
    left = (info.end_at.timestamp() - time.time())
    assert 200 < left <= 300  # E2B's default timeout, 300 s
    sb.set_timeout(1200)
    left = sb.get_info().end_at.timestamp() - time.time()
    assert 1100 < left <= 1200
    other = Sandbox.create(metadata={"who": "other"})
    try:
        ids = [s.sandbox_id for s in Sandbox.list().next_items()]
        assert sb.sandbox_id in ids and other.sandbox_id in ids
        mine = Sandbox.list(query=e2b.SandboxQuery(metadata={"who": "other"})).next_items()
        assert [s.sandbox_id for s in mine] == [other.sandbox_id] and mine[0].metadata == {"who": "other"}
    finally:
        other.kill()
    assert other.sandbox_id not in [s.sandbox_id for s in Sandbox.list().next_items()]


def test_pause_and_connect(sb):
    sb.run_code("state = 'kept across pause'")
    assert sb.pause() is True
    assert sb.get_info().state == e2b.SandboxState.PAUSED
    paused = Sandbox.list(query=e2b.SandboxQuery(state=[e2b.SandboxState.PAUSED])).next_items()
    assert sb.sandbox_id in [s.sandbox_id for s in paused]
    assert sb.run_code("state").text == "'kept across pause'"  # a paused sandbox wakes for a cell...
    assert sb.get_info().state == e2b.SandboxState.RUNNING
    assert sb.pause() is True and sb.pause() is False  # ...and a second pause is E2B's "already paused"
    again = Sandbox.connect(sb.sandbox_id)
    assert again.get_info().state == e2b.SandboxState.RUNNING
    assert again.run_code("state").text == "'kept across pause'"


def test_fork_and_snapshot(sb):
    sb.run_code("x = 41")
    snap = sb.create_snapshot()
    sb.run_code("x = 99")
    (child,) = sb.fork()
    try:
        assert child.sandbox_id != sb.sandbox_id
        assert child.run_code("x").text == "99"  # a fork is a copy of now
    finally:
        child.kill()
    restored = Sandbox.create(template=snap.snapshot_id)  # E2B starts a sandbox from a snapshot by its id
    try:
        assert restored.run_code("x").text == "41"
    finally:
        restored.kill()


def test_async_sdk(gw):
    async def go():
        s = await AsyncSandbox.create()
        try:
            ex = await s.run_code("print(6 * 7)")
            assert ex.logs.stdout == ["42\n"]
            await s.files.write("async.txt", "ok")
            assert await s.files.read("async.txt") == "ok"
        finally:
            await s.kill()

    asyncio.run(go())


# -- templates --------------------------------------------------------------------------------
def test_a_template_named_after_a_driver_picks_it(gw):
    s = Sandbox.create(template="gvisor")
    try:
        assert s.get_info().template_id == "gvisor"
        assert gw.request("GET", f"/api/sandboxes/{s.sandbox_id}").json()["driver"] == "gvisor"
        assert s.run_code("1+1").text == "2"
    finally:
        s.kill()
