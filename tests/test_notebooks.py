"""The notebooks in notebooks/ run top to bottom against a real `sandgate serve`, and say what they
should: specific values in specific cells, images where there are plots.

Five run on the host, in a local ipykernel (nbclient's own kernel manager) with SANDGATE_URL and
SANDGATE_TOKEN in its environment, and drive the gateway with the SDK. inside_a_sandbox.ipynb runs on
a Sandgate kernel: nbclient with jupyter_server's GatewayKernelManager pointed at the gateway."""

from __future__ import annotations

import ast
import base64
import json
import os
import re
import sys
from pathlib import Path
from threading import Thread

import nbformat
import pytest
import websocket
from jupyter_client.asynchronous import AsyncKernelClient
from jupyter_core.utils import ensure_async, run_sync
from jupyter_server.gateway.gateway_client import GatewayClient
from jupyter_server.gateway.managers import GatewayKernelClient, GatewayKernelManager
from jupyter_server.utils import url_escape, url_path_join
from nbclient import NotebookClient

from conftest import Gateway

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
HOST_NOTEBOOKS = ["quickstart.ipynb", "plots.ipynb", "checkpoint_fork.ipynb", "files_and_data.ipynb",
                  "agent_loop.ipynb"]


@pytest.fixture(scope="module")
def gw(home, tmp_path_factory):
    gw = Gateway(home, tmp_path_factory.mktemp("gw"), env={"SANDGATE_MAX_KERNELS": "6"})
    yield gw
    gw.stop()


def test_every_notebook_is_run_here():
    assert sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")) == sorted(HOST_NOTEBOOKS + ["inside_a_sandbox.ipynb"])


def stdout(nb, cell_id) -> str:
    cell = cell_by_id(nb, cell_id)
    return "".join(o["text"] for o in cell.outputs if o["output_type"] == "stream" and o["name"] == "stdout")


def bundles(nb, cell_id) -> list:
    return [o["data"] for o in cell_by_id(nb, cell_id).outputs if o["output_type"] in ("display_data",
                                                                                        "execute_result")]


def cell_by_id(nb, cell_id):
    found = [c for c in nb.cells if c.get("id") == cell_id]
    assert len(found) == 1, f"no cell {cell_id!r}"
    return found[0]


def check_committed_clean(path: Path):
    """Committed without outputs, and every code cell has an id the checks can name."""
    nb = nbformat.read(path, 4)
    nbformat.validate(nb)
    for c in nb.cells:
        if c.cell_type == "code":
            assert not c.outputs and c.execution_count is None, f"{path.name} cell {c.id} has outputs"
    return nb


@pytest.fixture
def local_python3(tmp_path, monkeypatch):
    """The kernelspec python3 is this interpreter's ipykernel, whatever other python3 specs the machine
    has (JUPYTER_PATH comes first): the kernel imports the same sandgate_client as the tests (PYTHONPATH
    passes through the environment)."""
    spec = tmp_path / "jupyter" / "kernels" / "python3"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (tests)", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))


def run_on_host(gw: Gateway, name: str, tmp_path) -> nbformat.NotebookNode:
    nb = check_committed_clean(NOTEBOOKS / name)
    env = {**os.environ, "SANDGATE_URL": gw.url, "SANDGATE_TOKEN": gw.token}
    client = NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
    client.execute(env=env)
    errors = [(c.id, o) for c in nb.cells if c.cell_type == "code" for o in c.outputs if o["output_type"] == "error"]
    assert not errors, errors
    # Every notebook deletes what it made.
    assert gw.request("GET", "/api/sandboxes").json() == []
    return nb


def test_quickstart(gw, tmp_path, local_python3):
    nb = run_on_host(gw, "quickstart.ipynb", tmp_path)
    assert stdout(nb, "connect") == f"gateway: {gw.url}\ntoken set: True\n"
    sid = re.fullmatch(r"sandbox (\S+) is running on gvisor\n", stdout(nb, "create")).group(1)
    run = stdout(nb, "run").splitlines()
    assert run[0] == "status: ok"
    assert re.fullmatch(r"stdout: inside: sandbox uid \d+ cwd /workspace", run[1]), run
    assert run[2] == "value: 42"
    assert stdout(nb, "state") == "answer + 1 = 43\n"
    assert stdout(nb, "stream") == ("streamed: ['tick', '0', 'tick', '1', 'tick', '2'] "
                                    "| same as ex.stdout: True\n")
    assert stdout(nb, "error") == "error - ZeroDivisionError: division by zero\nZeroDivisionError: division by zero\n"
    assert stdout(nb, "files") == "[('from_sandbox.txt', 22), ('hello.txt', 22)]\nWRITTEN FROM THE HOST\n"
    assert stdout(nb, "delete") == f"after delete: NotFound - Sandbox does not exist: {sid}\n"
    assert gw.request("GET", f"/api/sandboxes/{sid}").status == 404


def test_plots(gw, tmp_path, local_python3):
    nb = run_on_host(gw, "plots.ipynb", tmp_path)
    assert re.fullmatch(r"in the sandbox: matplotlib 3\.\d+\.\d+, numpy \d+\.\d+\.\d+\n", stdout(nb, "check"))
    m = re.fullmatch(r"ok - 1 PNG, (\d+) bytes; max = 0\.88\n", stdout(nb, "plot"))
    assert m, stdout(nb, "plot")
    # The sandbox's PNG is shown in the host notebook, byte for byte what run_code returned.
    [shown] = bundles(nb, "plot")
    png = base64.b64decode(shown["image/png"])
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) == int(m.group(1))
    [svg] = bundles(nb, "svg")
    assert "<svg" in svg["image/svg+xml"] and "</svg>" in svg["image/svg+xml"]
    assert re.fullmatch(r"bars\.svg: \d+ characters, starts with <\?xml\n", stdout(nb, "svg"))


def test_checkpoint_fork(gw, tmp_path, local_python3):
    nb = run_on_host(gw, "checkpoint_fork.ipynb", tmp_path)
    steps, position = ast.literal_eval(stdout(nb, "setup").split(": ", 1)[1])
    assert steps == 101
    assert stdout(nb, "checkpoint") == "checkpoint after-100-steps of sandbox sb\n"
    lines = stdout(nb, "fork").splitlines()
    assert [re.sub(r"fork \w+ ", "fork ", x) for x in lines[:2]] == [
        "fork from sandbox sb: True at the checkpoint: True"] * 2
    up = ast.literal_eval(lines[2].split(": ", 1)[1].split(":", 1)[1])
    down = ast.literal_eval(lines[3].split(": ", 1)[1].split(":", 1)[1])
    # Both forks start where the checkpoint left off, then diverge: one up, one down.
    assert up[:2] == down[:2] == (151, position)
    assert up[2] > position > down[2]
    assert stdout(nb, "diverge") == ("up sees 100 steps, seed 7 | strategy: up\n"
                                     "down sees 100 steps, seed 7 | strategy: down\n")
    assert stdout(nb, "original") == "original: steps = 101 | strategy.txt exists: False\n"
    assert stdout(nb, "cleanup") == "checkpoints of sb: ['after-100-steps']\n"


def test_files_and_data(gw, tmp_path, local_python3):
    nb = run_on_host(gw, "files_and_data.ipynb", tmp_path)
    assert stdout(nb, "make") == "36 rows; 1,north,17\n"
    assert stdout(nb, "upload") == "[('sales.csv', 'file', 449)]\n"
    assert stdout(nb, "process") == "ok - 36 rows read\n['summary.json', 'totals.csv']\n"
    assert stdout(nb, "read") == ("totals: {'north': 416, 'south': 472, 'west': 428} best month: 3\n"
                                  "same as computed on the host: True\n"
                                  "region,units\nnorth,416\nsouth,472\nwest,428\n")
    assert stdout(nb, "binary") == "round trip intact: True\nafter remove, exists: False\n"


def test_agent_loop(gw, tmp_path, local_python3):
    nb = run_on_host(gw, "agent_loop.ipynb", tmp_path)
    tools = stdout(nb, "tools").splitlines()
    assert ast.literal_eval(tools[0]) == ["execute_code", "read_file", "write_file", "list_files", "checkpoint",
                                          "fork", "restore"]
    assert json.loads(tools[1]) == ["code"]
    calls = [" ".join(x.split()) for x in stdout(nb, "loop").splitlines()]
    assert calls[0] == "write_file error=False ['text'] wrote 16 bytes to numbers.txt"
    # The misspelt argument is a tool error, and the loop goes on.
    assert calls[1].startswith("execute_code error=True ['text'] bad arguments for execute_code: code: Field req")
    assert calls[2] == "execute_code error=False ['text'] result: 31"
    assert calls[3] == "execute_code error=False ['image']"
    assert re.fullmatch(r"checkpoint error=False \['text'\] checkpoint \w+ of sandbox .*", calls[4])
    assert calls[5] == "list_files error=False ['text'] numbers.txt file 16"
    # The scripted model's answer quotes what execute_code returned: results were fed back.
    assert calls[6:] == ["model: The numbers sum to 31.", "sandboxes deleted: 1"]
    assert stdout(nb, "transcript") == ("True bad arguments for execute_code: code: Field required; "
                                        "cod: Extra inputs are not permitted\n14 messages; 1 image block(s) sent back\n")


class TokenGatewayKernelClient(GatewayKernelClient):
    """jupyter_server's GatewayKernelClient, but its websocket carries the gateway token.

    In jupyter_server 2.21 the REST calls of GatewayKernelManager send GatewayClient.auth_token, but
    GatewayKernelClient.start_channels opens the websocket with no header at all, so a gateway with a
    token answers 401 (notebooks/README.md). This is its start_channels with the Authorization header."""

    async def start_channels(self, shell=True, iopub=True, stdin=True, hb=True, control=True):
        gc = GatewayClient.instance()
        self.channel_socket = websocket.create_connection(
            url_path_join(gc.ws_url, gc.kernels_endpoint, url_escape(self.kernel_id), "channels"),
            timeout=gc.KERNEL_LAUNCH_TIMEOUT, enable_multithread=True,
            header=[f"{gc.auth_header_key}: {gc.auth_scheme} {gc.auth_token}"])
        await ensure_async(AsyncKernelClient.start_channels(self, shell=shell, iopub=iopub, stdin=stdin, hb=hb,
                                                            control=control))
        self.response_router = Thread(target=self._route_responses)
        self.response_router.start()


@pytest.mark.parametrize("auth", ["token", "no-token"])
def test_inside_a_sandbox_on_a_gateway_kernel(gw, home, tmp_path, auth):
    """With a token: GatewayKernelManager and the client above. Without (a gateway started with
    SANDGATE_TOKEN empty, as notebooks/README.md describes for `jupyter nbconvert`): jupyter_server's
    classes unchanged."""
    nb = check_committed_clean(NOTEBOOKS / "inside_a_sandbox.ipynb")
    target = gw if auth == "token" else Gateway(home, tmp_path, token="", args=("--ip", "127.0.0.1"))
    try:
        gc = GatewayClient.instance()
        gc.url, gc.ws_url, gc.auth_token = target.url, target.url.replace("http", "ws", 1), target.token
        gc.request_timeout = 120.0
        km = GatewayKernelManager(client_factory=TokenGatewayKernelClient) if auth == "token" else GatewayKernelManager()
        try:
            NotebookClient(nb, km=km, timeout=120, kernel_name="python3").execute()
            # The kernel nbclient used is the gateway's, in a gVisor sandbox.
            kernel = target.request("GET", f"/api/kernels/{km.kernel_id}")
            assert kernel.status == 200 and kernel.json()["driver"] == "gvisor"
        finally:
            if km.has_kernel:
                run_sync(km.shutdown_kernel)()   # nbclient shuts down only kernel managers it made
        assert target.request("GET", f"/api/kernels/{km.kernel_id}").status == 404
    finally:
        if target is not gw:
            target.stop()

    errors = [(c.id, o) for c in nb.cells if c.cell_type == "code" for o in c.outputs if o["output_type"] == "error"]
    assert not errors, errors
    where = stdout(nb, "where").splitlines()
    assert re.fullmatch(r"python 3\.\d+\.\d+ on Linux", where[0]), where
    # Not this machine: the sandbox's hostname, workspace and user.
    assert re.fullmatch(r"cwd /workspace uid \d+ hostname sandbox", where[1]), where
    assert int(where[1].split()[3]) != os.getuid()
    [plot] = bundles(nb, "plot")
    assert base64.b64decode(plot["image/png"]).startswith(b"\x89PNG\r\n\x1a\n")
    net = stdout(nb, "net").splitlines()
    assert [line.split(" unreachable: ")[0] for line in net] == ["1.1.1.1", "pypi.org"], net
    assert stdout(nb, "ws") == ("['hello.txt']\n"
                                "image root: PermissionError [Errno 13] Permission denied: '/usr/evil.txt'\n")
