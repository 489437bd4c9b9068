"""A raw websocket client in another language: tests/node/execute.js (Node and the `ws` package,
nothing of Sandgate's) runs `1+1` on a kernel of a real gateway over /api/kernels/{id}/channels."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

NODE_DIR = Path(__file__).resolve().parent / "node"


@pytest.fixture(scope="module")
def node_client():
    for tool in ("node", "npm"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} is not on PATH: install Debian's nodejs and npm (apt-get install -y nodejs npm); "
                        "tests/test_node_client.py runs tests/node/execute.js with it")
    if not (NODE_DIR / "node_modules" / "ws" / "package.json").exists():
        # The versions package-lock.json pins, from the npm registry.
        r = subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=NODE_DIR, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, f"npm ci failed in {NODE_DIR}:\n{r.stdout}\n{r.stderr}"
    return NODE_DIR / "execute.js"


def run_node(script, *args):
    return subprocess.run(["node", str(script), *args], capture_output=True, text=True, timeout=180,
                          env={**os.environ, "SANDGATE_URL": "", "SANDGATE_TOKEN": ""})


def test_node_ws_client_executes_a_cell(gateway, node_client):
    r = run_node(node_client, gateway.url, gateway.token)
    assert r.returncode == 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    lines = r.stdout.splitlines()
    kid = re.fullmatch(r"kernel (\S+) started", lines[0]).group(1)
    assert lines[1] == 'sent execute_request "1+1"'
    assert lines[-1] == f"kernel {kid} deleted"
    # Only the messages answering our request: iopub busy, the input echoed, the value 2, idle, and
    # the shell reply (which may come before or after the idle status: they travel on two channels).
    session = lines[2:-1]
    assert sorted(session) == sorted(["iopub status: busy", "iopub execute_input [1]: 1+1",
                                      "iopub execute_result [1]: 2", "iopub status: idle",
                                      "shell execute_reply: ok"]), r.stdout
    iopub = [line for line in session if line.startswith("iopub")]
    assert iopub == ["iopub status: busy", "iopub execute_input [1]: 1+1", "iopub execute_result [1]: 2",
                     "iopub status: idle"], r.stdout
    # The script deleted its kernel.
    assert gateway.request("GET", f"/api/kernels/{kid}").status == 404


def test_node_ws_client_with_a_wrong_token_fails_cleanly(gateway, node_client):
    r = run_node(node_client, gateway.url, "not-the-token")
    assert r.returncode == 1
    assert "401" in r.stderr, r.stderr
