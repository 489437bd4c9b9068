"""A real jupyter_server started with --gateway-url runs a cell in a sandgate
kernel: what `jupyter lab --gateway-url` does, minus the browser."""

import json
import os
import subprocess
import sys
import time
import urllib.request
import uuid

import websocket

from conftest import free_port, wait_for


def test_jupyter_server_gateway_client(gateway, tmp_path):
    port = free_port()
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(tmp_path / "cfg"), "JUPYTER_DATA_DIR": str(tmp_path / "data"),
           "JUPYTER_RUNTIME_DIR": str(tmp_path / "rt")}
    log = open(tmp_path / "jupyter.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyter_server", "--no-browser", "--allow-root", f"--port={port}", "--ip=127.0.0.1",
         f"--ServerApp.root_dir={tmp_path}", "--IdentityProvider.token=jtok",
         f"--gateway-url={gateway.url}", f"--GatewayClient.auth_token={gateway.token}",
         "--GatewayClient.request_timeout=120"],
        env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"

    def call(method, path, body=None):
        req = urllib.request.Request(base + path, method=method, data=json.dumps(body).encode() if body else None,
                                     headers={"Authorization": "token jtok", "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=180) as r:
            return r.status, json.loads(r.read() or b"null")

    try:
        def up():
            try:
                return call("GET", "/api/kernelspecs")
            except OSError:
                return None

        status, specs = wait_for(up, timeout=60)
        # jupyter_server shows the gateway's kernelspecs, not its own.
        assert "python3-gvisor" in specs["kernelspecs"]
        status, session = call("POST", "/api/sessions", {"path": "nb.ipynb", "type": "notebook", "name": "nb",
                                                         "kernel": {"name": "python3"}})
        assert status == 201
        kid = session["kernel"]["id"]
        # The kernel really lives in the gateway.
        assert gateway.request("GET", f"/api/kernels/{kid}").status == 200

        sid = uuid.uuid4().hex
        # Raw: a Jupyter client of jupyter_server (not of Sandgate), as a browser's would be.
        ws = websocket.create_connection(f"ws://127.0.0.1:{port}/api/kernels/{kid}/channels?session_id={sid}",
                                         header=["Authorization: token jtok"], timeout=120)
        msg_id = uuid.uuid4().hex
        ws.send(json.dumps({"channel": "shell", "header": {"msg_id": msg_id, "msg_type": "execute_request",
                                                           "session": sid, "username": "u", "version": "5.3",
                                                           "date": "2026-01-01T00:00:00Z"},
                            "parent_header": {}, "metadata": {},
                            "content": {"code": "import os\n6 * 7", "silent": False}}))
        result, deadline = None, time.monotonic() + 120
        while result is None and time.monotonic() < deadline:
            m = json.loads(ws.recv())
            if m.get("msg_type") == "execute_result" and m["parent_header"].get("msg_id") == msg_id:
                result = m["content"]["data"]["text/plain"]
        assert result == "42"
        ws.close()

        status, kernels = call("GET", "/api/kernels")
        assert kid in [k["id"] for k in kernels]
        assert call("DELETE", f"/api/sessions/{session['id']}")[0] == 204
        wait_for(lambda: gateway.request("GET", f"/api/kernels/{kid}").status == 404)
    finally:
        server.terminate()
        server.wait(30)
        log.close()
