"""The sandgate_lab package as pip installs it: its committed JavaScript build matches lab/'s
sources, pyproject.toml ships every file of that build where JupyterLab looks for prebuilt
extensions along with the config that enables the server part, and a Lab server without
--gateway-url loads it and says why there is no sandbox. (The browser test,
test_jupyterlab_sandbox.py, drives it against a gateway.)"""

import json
import os
import subprocess
import sys
import tomllib
import urllib.error
import urllib.request
import uuid
from pathlib import Path

from conftest import free_port, wait_for

REPO = Path(__file__).resolve().parent.parent
LAB = REPO / "lab"
BUILD = LAB / "sandgate_lab" / "labextension"


def test_the_committed_build_matches_its_sources():
    from sandgate_lab import buildstamp

    assert (BUILD / "sources.sha256").read_text().strip() == buildstamp.digest(), (
        "lab/sandgate_lab/labextension was not rebuilt after a change to lab/'s sources: run lab/build.sh "
        "and commit what it writes")
    meta = json.loads((BUILD / "package.json").read_text())
    assert meta["name"] == "sandgate-lab"
    assert (BUILD / meta["jupyterlab"]["_build"]["load"]).is_file()


def test_pip_install_ships_the_extension_and_enables_the_server_part():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    setuptools = project["tool"]["setuptools"]
    assert setuptools["package-dir"]["sandgate_lab"] == "lab/sandgate_lab"
    assert "sandgate_lab" in setuptools["packages"]
    shipped = {}
    for target, patterns in setuptools["data-files"].items():
        for pattern in patterns:
            for f in REPO.glob(pattern):
                shipped[f.resolve()] = target
    built = [f.resolve() for f in BUILD.rglob("*") if f.is_file() and f.name != "sources.sha256"]
    assert built
    for f in built:
        # share/jupyter/labextensions/<name>/<its path in the build>: where Lab finds it.
        want = "share/jupyter/labextensions/sandgate-lab/" + f.parent.relative_to(BUILD.resolve()).as_posix()
        assert shipped.get(f, "").rstrip("/.") == want.rstrip("/."), (f, shipped.get(f))
    config = (LAB / "jupyter-config" / "sandgate_lab.json").resolve()
    assert shipped[config] == "etc/jupyter/jupyter_server_config.d"
    assert json.loads(config.read_text()) == {"ServerApp": {"jpserver_extensions": {"sandgate_lab": True}}}


def test_without_a_gateway_the_server_part_says_so(tmp_path):
    cfg = tmp_path / "cfg"
    cfg.mkdir()
    (cfg / "jupyter_server_config.json").write_text(
        json.dumps({"ServerApp": {"jpserver_extensions": {"sandgate_lab": True}}}))
    port = free_port()
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(cfg), "JUPYTER_RUNTIME_DIR": str(tmp_path / "rt"),
           "JUPYTER_DATA_DIR": str(tmp_path / "data")}
    env.pop("JUPYTER_GATEWAY_URL", None)
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "jupyter_server", "--no-browser", "--allow-root",
                             f"--port={port}", "--ip=127.0.0.1", f"--ServerApp.root_dir={tmp_path}",
                             "--IdentityProvider.token=jtok"],
                            env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"

    def get(path):
        req = urllib.request.Request(base + path, headers={"Authorization": "token jtok"})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()
        except OSError:
            return None, b""

    try:
        wait_for(lambda: get("/api/status")[0] == 200 or proc.poll() is not None, timeout=90)
        assert proc.poll() is None, (tmp_path / "server.log").read_text()
        status, body = get(f"/sandgate/api/kernels/{uuid.uuid4()}")
        assert status == 409, (status, body)
        reply = json.loads(body)
        assert reply["code"] == "no_gateway" and "--gateway-url" in reply["message"], reply
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
