"""Kernel websocket: rich output, stdin, interrupt, restart, crashes and
reconnects, all on real gVisor kernels (the wire formats, bad frames and the
upgrade's statuses are tests/unit/test_channels.py's)."""

import base64
import threading

from conftest import ANSI, wait_for


def test_streams_errors_and_state(gateway, kernel):
    c = gateway.connect(kernel)
    out = c.execute("import sys\nx = 41\nprint('out'); print('err', file=sys.stderr)")
    assert out["stdout"] == "out\n" and out["stderr"] == "err\n"
    assert c.execute("x + 1")["results"][0]["text/plain"] == "42"
    out = c.execute("def f():\n    raise ValueError('boom')\nf()")
    assert out["reply"]["status"] == "error"
    err = out["errors"][0]
    assert err["ename"] == "ValueError" and err["evalue"] == "boom"
    assert any("raise ValueError" in ANSI.sub("", line) for line in err["traceback"])
    c.close()


def test_a_cells_output_comes_before_its_reply(gateway, kernel):
    """Shell and IOPub share the kernel's pipe to the agent, in the order the
    kernel sent them, and a flush returns with its output sent: whatever the
    cell printed reaches the client before the execute_reply, the last line too."""
    c = gateway.connect(kernel)
    for _ in range(5):
        out = c.execute("import sys\nfor i in range(300): print(i)\nprint('last', file=sys.stderr)")
        kinds = [m["msg_type"] for m in out["msgs"]]
        assert "stream" not in kinds[kinds.index("execute_reply"):], kinds
        assert out["stdout"] == "".join(f"{i}\n" for i in range(300)) and out["stderr"] == "last\n"
    c.close()


def test_matplotlib_png(gateway, kernel):
    c = gateway.connect(kernel)
    out = c.execute("%matplotlib inline\nimport matplotlib.pyplot as plt\nplt.plot([1, 3, 2]); plt.show()")
    png = [d for d in out["displays"] if "image/png" in d]
    assert png, out
    assert base64.b64decode(png[0]["image/png"])[:8] == b"\x89PNG\r\n\x1a\n"
    out = c.execute("import numpy as np, pandas as pd\npd.DataFrame({'a': np.arange(3)})")
    assert "text/html" in out["results"][0]
    c.close()


def test_input_over_stdin(gateway, kernel):
    c = gateway.connect(kernel)
    out = c.execute("name = input('who? ')\nprint('hello', name)", stdin_reply="sandgate")
    assert "hello sandgate" in out["stdout"]
    assert any(m["msg_type"] == "input_request" and m["content"]["prompt"] == "who? " for m in out["msgs"])
    c.close()


def test_interrupt_infinite_loop(gateway, kernel):
    c = gateway.connect(kernel)
    result = {}
    t = threading.Thread(target=lambda: result.update(c.execute("print('looping', flush=True)\nwhile True:\n    pass",
                                                                  timeout=60)))
    t.start()
    # In the loop: busy alone comes before the cell's code runs.
    wait_for(lambda: any(m["msg_type"] == "stream" and "looping" in m["content"]["text"] for m in list(c.seen)))
    assert gateway.request("GET", f"/api/kernels/{kernel}").json()["execution_state"] == "busy"
    assert gateway.request("POST", f"/api/kernels/{kernel}/interrupt", {}).status == 204
    t.join(60)
    assert not t.is_alive()
    assert result["reply"]["status"] == "error" and result["errors"][0]["ename"] == "KeyboardInterrupt"
    assert c.execute("'still alive'")["results"][0]["text/plain"] == "'still alive'"
    c.close()


def test_interrupting_a_cell_that_floods_output_leaves_the_kernel_answering(gateway, kernel):
    """An interrupt that lands while the kernel writes a message to the agent
    must not cut it in two (the agent would lose its place in the pipe)."""
    c = gateway.connect(kernel)
    for _ in range(3):
        result = {}
        t = threading.Thread(target=lambda: result.update(c.execute(
            "import sys\nwhile True:\n    sys.stdout.write('x' * 20000 + '\\n'); sys.stdout.flush()", timeout=60)))
        t.start()
        wait_for(lambda: gateway.request("GET", f"/api/kernels/{kernel}").json()["execution_state"] == "busy")
        assert gateway.request("POST", f"/api/kernels/{kernel}/interrupt", {}).status == 204
        t.join(60)
        assert not t.is_alive()
        assert result["errors"][0]["ename"] == "KeyboardInterrupt", result["reply"]
        assert c.execute("1 + 1")["results"][0]["text/plain"] == "2"
    c.close()


def test_restart_clears_state(gateway):
    kid = gateway.start_kernel()
    try:
        c = gateway.connect(kid)
        c.execute("y = 5")
        c.execute("open('kept.txt', 'w').write('files survive restarts')")
        assert gateway.request("POST", f"/api/kernels/{kid}/restart", {}).status == 200
        out = c.execute("y")
        assert out["errors"][0]["ename"] == "NameError"
        # A requested restart says "starting" then "idle", never "restarting": to Jupyter
        # clients that means the kernel died (JupyterLab shows "kernel appears to have died").
        states = [m["content"]["execution_state"] for m in c.seen
                  if m["msg_type"] == "status" and not m["parent_header"]]
        assert "starting" in states and states[-1] == "idle" and "restarting" not in states, states
        assert "files survive" in c.execute("print(open('kept.txt').read())")["stdout"]
        c.close()
    finally:
        gateway.request("DELETE", f"/api/kernels/{kid}")


def test_kernel_crash_is_answered_and_recovered(gateway):
    kid = gateway.start_kernel()
    other = gateway.start_kernel()
    try:
        c = gateway.connect(kid)
        c.execute("z = 1")
        mark = len(c.seen)
        out = c.execute("import os; os._exit(1)")
        # No client is left waiting: the cell gets an error reply.
        assert out["reply"]["status"] == "error" and out["reply"]["ename"] == "DeadKernelError"
        # Clients were told the kernel was restarting, and the kernel comes back fresh.
        def states():
            return [m["content"]["execution_state"] for m in c.seen[mark:] if m["msg_type"] == "status"
                    and not m["parent_header"]]
        while "idle" not in states():
            c.recv(timeout=60)
        assert states()[0] == "restarting" and states()[-1] == "idle"
        assert c.execute("z")["errors"][0]["ename"] == "NameError"
        assert c.execute("2+2")["results"][0]["text/plain"] == "4"
        assert "ipykernel exited with status 1; restarting it" in gateway.log_text()
        # The other kernel never noticed.
        o = gateway.connect(other)
        assert o.execute("'other'")["results"][0]["text/plain"] == "'other'"
        c.close()
        o.close()
    finally:
        gateway.request("DELETE", f"/api/kernels/{kid}")
        gateway.request("DELETE", f"/api/kernels/{other}")


def test_output_while_disconnected_is_replayed(gateway, kernel):
    c = gateway.connect(kernel)
    code = "import os, time\nwhile not os.path.exists('go'): time.sleep(0.05)\nprint('while you were away')"
    mid = c.send("execute_request", {"code": code, "silent": False})
    while True:  # the cell has begun; it prints once the test says so
        m = c.recv(timeout=30)
        if m["parent_header"].get("msg_id") == mid and m["msg_type"] == "status":
            assert m["content"]["execution_state"] == "busy"
            break
    c.close()
    state = lambda: gateway.request("GET", f"/api/kernels/{kernel}").json()  # noqa: E731
    wait_for(lambda: state()["connections"] == 0)
    gateway.sandbox(kernel).files.write("go", b"")
    wait_for(lambda: state()["execution_state"] == "idle", timeout=60)  # it printed with nobody connected
    c2 = gateway.connect(kernel, session=c.session)
    seen = []
    while not any(m["msg_type"] == "stream" for m in seen):
        seen.append(c2.recv(timeout=30))
    assert [m for m in seen if m["msg_type"] == "stream"][0]["content"]["text"] == "while you were away\n"
    c2.close()
