"""The sandgate_lab extension in a real browser: JupyterLab with --gateway-url against a real
gateway (runsc), driven in Debian's chromium by playwright. From the Sandbox panel: a
checkpoint of `x = 41`, then `x = 42`, a fork from that checkpoint (a copy of the notebook
beside it whose kernel has 41), pause to disk and resume; the kernel's workspace as a drive:
a file a cell wrote is listed and opens in the editor, an edit saved there and a file
uploaded there are what the next cells read; errors: the gateway's message in a
notification and through the server part; a deleted kernel's panel says so.

Screenshots: jupyterlab-sandbox-panel.png and jupyterlab-workspace.png in the test's tmp
dir, also copied to docs/images/ with SANDGATE_DOCS_SCREENSHOT=1."""

import json
import os
import re
import shutil
import subprocess
import sys
import urllib.request
import uuid
from pathlib import Path

import nbformat
import pytest
from playwright.sync_api import expect, sync_playwright

from conftest import Gateway, free_port, wait_for

# Slow: two kernels, a checkpoint, a fork and a pause to disk, each a runsc checkpoint or restore.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

CHROMIUM = "/usr/bin/chromium"
T = 60_000  # every wait on the page, in ms: CI shares two cores with the sandboxes
REPO = Path(__file__).resolve().parent.parent
LABEXTENSION = REPO / "lab" / "sandgate_lab" / "labextension"
DOCS = REPO / "docs" / "images"
UPLOADED = "dropped into the workspace from Lab\n"

CELLS = [
    "x = 41",
    "x = 42",
    "print(x)",
    "open('from_cell.txt', 'w').write('written by a cell')",
    "print(open('from_lab.txt').read())",
    "print(open('from_cell.txt').read())",
    "open('third.txt', 'w').write('one file too many for a checkpoint')",
]


@pytest.fixture(scope="module")
def gateway(home, tmp_path_factory):
    # Two files at most in a checkpoint: the third file the notebook writes makes the
    # panel's last Checkpoint fail with the gateway's message.
    gw = Gateway(home, tmp_path_factory.mktemp("gw"),
                 env={"SANDGATE_MAX_KERNELS": "4", "SANDGATE_CHECKPOINT_MAX_FILES": "2"})
    yield gw
    gw.stop()


@pytest.fixture
def lab(gateway, tmp_path):
    """`jupyter lab --gateway-url` with this checkout's sandgate_lab (server extension and
    prebuilt Lab extension), its root a directory holding nb.ipynb."""
    root = tmp_path / "root"
    root.mkdir()
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (gVisor sandbox)", "language": "python"}
    nbformat.write(nb, root / "nb.ipynb")
    settings = tmp_path / "settings"
    (settings / "@jupyterlab" / "apputils-extension").mkdir(parents=True)
    (settings / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings").write_text(
        json.dumps({"fetchNews": "false", "checkForUpdates": False}))
    # What `pip install` puts in share/jupyter and etc/jupyter, from this checkout: an
    # installed copy elsewhere would otherwise be what runs.
    extensions = tmp_path / "labextensions"
    extensions.mkdir()
    (extensions / "sandgate-lab").symlink_to(LABEXTENSION)
    cfg = tmp_path / "cfg"
    cfg.mkdir()
    (cfg / "jupyter_server_config.json").write_text(
        json.dumps({"ServerApp": {"jpserver_extensions": {"sandgate_lab": True}}}))
    port = free_port()
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(cfg), "JUPYTER_DATA_DIR": str(tmp_path / "data"),
           "JUPYTER_RUNTIME_DIR": str(tmp_path / "rt"), "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "ws"),
           "JUPYTERLAB_SETTINGS_DIR": str(settings)}
    log_path = tmp_path / "jupyterlab.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root", f"--port={port}", "--ip=127.0.0.1",
         f"--ServerApp.root_dir={root}", "--IdentityProvider.token=jtok",
         f"--LabApp.extra_labextensions_path={extensions}",
         f"--gateway-url={gateway.url}", f"--GatewayClient.auth_token={gateway.token}",
         "--GatewayClient.request_timeout=120"],
        env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"

    def up():
        try:
            with urllib.request.urlopen(f"{base}/api/status?token=jtok", timeout=5) as r:
                return r.status == 200
        except OSError:
            return proc.poll() is not None

    try:
        wait_for(up, timeout=90)
        assert proc.poll() is None, log_path.read_text()
        assert "sandgate_lab" in log_path.read_text(), "the server extension did not load: " + log_path.read_text()
        yield base, root
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def test_sandbox_panel_and_workspace_drive(gateway, lab, tmp_path):
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True)
        page = browser.new_page(viewport={"width": 1500, "height": 950})
        try:
            _drive(gateway, page, *lab, tmp_path)
        except BaseException:
            page.screenshot(path=str(tmp_path / "failure.png"))
            (tmp_path / "failure.html").write_text(page.content())
            raise
        finally:
            browser.close()


def _shot(page, tmp_path, name):
    shot = tmp_path / name
    page.screenshot(path=str(shot))
    assert shot.stat().st_size > 20_000
    if os.environ.get("SANDGATE_DOCS_SCREENSHOT"):
        DOCS.mkdir(exist_ok=True)
        shutil.copyfile(shot, DOCS / name)


def _drive(gateway, page, base, root, tmp_path):
    page.set_default_timeout(T)
    auth = {"Authorization": "token jtok"}
    page.goto(f"{base}/lab/tree/nb.ipynb?token=jtok")
    notebooks = page.locator(".jp-NotebookPanel")
    expect(notebooks.first.locator(".jp-Cell")).to_have_count(len(CELLS), timeout=2 * T)
    kernels = wait_for(lambda: gateway.request("GET", "/api/kernels").json(), timeout=2 * T / 1000)
    assert len(kernels) == 1, kernels
    kid = kernels[0]["id"]
    original = notebooks.first
    fork_nb = None

    def status(nb):
        return nb.locator(".jp-NotebookPanel-toolbar [data-jp-item-name=executionProgress] "
                          ".jp-Notebook-ExecutionIndicator")

    def activate(nb):
        # Lab's notebook commands act on the current notebook: its tab makes it so.
        name = "nb.ipynb" if nb is original else fork_nb
        page.locator(".lm-DockPanel-tabBar .lm-TabBar-tabLabel").get_by_text(name, exact=True).click()
        expect(page.locator(".jp-StatusBar-Widget", has_text=name).first).to_be_visible(timeout=T)

    def run(nb, i, expect_text=None):
        activate(nb)
        cell = nb.locator(".jp-Cell").nth(i)
        cell.locator(".jp-InputPrompt").click()
        expect(cell).to_have_class(re.compile(r"\bjp-mod-selected\b"), timeout=T)
        nb.locator('jp-button[data-command="notebook:run-cell-and-select-next"]').click()
        if expect_text is not None:
            expect(cell.locator(".jp-OutputArea-output")).to_have_text(expect_text, timeout=2 * T)
        expect(cell.locator(".jp-InputPrompt")).to_have_text(re.compile(r"\[\d+\]:"), timeout=2 * T)

    expect(status(original)).to_have_attribute("data-status", "idle", timeout=2 * T)

    # The Sandbox panel, in the right sidebar, shows this notebook's kernel.
    page.locator('.jp-SideBar.jp-mod-right .lm-TabBar-tab[data-id="sandgate-sandbox-panel"]').click()
    panel = page.locator("#sandgate-sandbox-panel")
    fact = lambda name: panel.locator(f"tr[data-field={name}] td")  # noqa: E731
    expect(fact("kernel")).to_have_text(kid, timeout=T)
    expect(fact("state")).to_have_text(re.compile(r"^running"), timeout=T)
    expect(fact("driver")).to_have_text("gvisor")
    expect(fact("memory")).to_contain_text("1024 MB limit")

    run(original, 0)
    panel.locator(".sg-Panel-name").fill("forty-one")
    panel.locator('.sg-Panel-checkpointRow button[data-command="sandgate:checkpoint"]').click()
    cp_item = panel.locator("li.sg-Panel-checkpoint", has_text="forty-one")
    expect(cp_item).to_be_visible(timeout=2 * T)
    cps = gateway.request("GET", f"/api/sandboxes/{kid}/checkpoints").json()
    assert [c["name"] for c in cps] == ["forty-one"], cps
    cp = cps[0]["id"]
    assert cp_item.get_attribute("data-checkpoint") == cp
    run(original, 1)

    # Fork from the checkpoint: a copy of the notebook opens beside the original, attached to
    # the forked kernel, whose x is the checkpoint's.
    cp_item.locator('button[data-command="sandgate:fork"]').click()
    expect(notebooks).to_have_count(2, timeout=2 * T)
    forks = wait_for(lambda: [s for s in gateway.request("GET", "/api/sandboxes").json()
                              if (s["parent"] or {}).get("checkpoint") == cp], timeout=2 * T / 1000)
    assert len(forks) == 1, forks
    fork_id = forks[0]["id"]
    fork_nb = f"nb-fork-{fork_id[:8]}.ipynb"
    assert (root / fork_nb).exists()
    sessions = wait_for(lambda: [s for s in page.request.get(f"{base}/api/sessions", headers=auth).json()
                                 if s["path"] == fork_nb], timeout=2 * T / 1000)
    assert sessions[0]["kernel"]["id"] == fork_id, sessions
    # Beside it: the copy is the right-hand one.
    boxes = [notebooks.nth(i).bounding_box() for i in range(2)]
    forked = notebooks.nth(0 if boxes[0]["x"] > boxes[1]["x"] else 1)
    original = notebooks.nth(1 if boxes[0]["x"] > boxes[1]["x"] else 0)
    # (Its toolbar's execution indicator is in the toolbar's overflow menu at half width; the
    # cell's output is what counts.)
    run(forked, 2, "41")
    run(original, 2, "42")
    # The panel follows the current notebook; back on the original, it shows the fork.
    activate(original)
    expect(fact("kernel")).to_have_text(kid, timeout=T)
    expect(cp_item.locator(".sg-Panel-fork")).to_have_text(f"fork {fork_id[:8]} (running)", timeout=T)
    _shot(page, tmp_path, "jupyterlab-sandbox-panel.png")

    # Pause to disk and resume, from the panel; the kernel keeps its x.
    panel.locator('button[data-command="sandgate:pause-disk"]').click()
    expect(fact("state")).to_have_text("paused", timeout=2 * T)
    assert gateway.request("GET", f"/api/sandboxes/{kid}").json()["state"] == "paused"
    panel.locator('button[data-command="sandgate:resume"]').click()
    expect(fact("state")).to_have_text(re.compile(r"^running"), timeout=2 * T)
    run(original, 2, "42")

    # The workspace drive, in the left sidebar: a file the cell wrote is listed.
    run(original, 3)
    page.locator('.jp-SideBar.jp-mod-left .lm-TabBar-tab[data-id="sandgate-workspace"]').click()
    workspace = page.locator("#sandgate-workspace")
    expect(workspace.locator(".sg-Workspace-header")).to_contain_text(kid[:8], timeout=T)
    item = lambda name: workspace.locator(".jp-DirListing-item", has_text=name)  # noqa: E731
    expect(item("from_cell.txt")).to_be_visible(timeout=T)

    # Uploaded there, read by the next cell.
    upload = tmp_path / "from_lab.txt"
    upload.write_text(UPLOADED)
    with page.expect_file_chooser() as chooser:
        workspace.locator("[data-jp-item-name=upload]").locator("button, jp-button").first.click()
    chooser.value.set_files(str(upload))
    expect(item("from_lab.txt")).to_be_visible(timeout=T)
    assert gateway.request("GET", f"/api/sandboxes/{kid}/files/from_lab.txt").body == UPLOADED.encode()
    run(original, 4, UPLOADED.strip())
    # A file over Lab's 1 MiB chunk size goes up in chunks, spooled by the Lab server and sent
    # to the sandbox whole with the last.
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(3 << 20) + b"end")
    with page.expect_file_chooser() as chooser:
        workspace.locator("[data-jp-item-name=upload]").locator("button, jp-button").first.click()
    chooser.value.set_files(str(big))
    expect(item("big.bin")).to_be_visible(timeout=2 * T)
    wait_for(lambda: gateway.request("GET", f"/api/sandboxes/{kid}/files/big.bin").body == big.read_bytes(),
             timeout=T / 1000)

    # Opened in Lab's editor, edited and saved there, read by the next cell.
    item("from_cell.txt").dblclick()
    editor = page.locator(".jp-FileEditor .cm-content")
    expect(editor).to_have_text("written by a cell", timeout=T)
    editor.click()
    page.keyboard.press("Control+End")
    page.keyboard.type(", edited in Lab")
    page.keyboard.press("Control+s")
    edited = "written by a cell, edited in Lab"
    wait_for(lambda: gateway.request("GET", f"/api/sandboxes/{kid}/files/from_cell.txt").body == edited.encode(),
             timeout=T / 1000)
    # Download: the bytes, as an attachment.
    down = page.request.get(f"{base}/sandgate/api/kernels/{kid}/files/from_lab.txt?download=1", headers=auth)
    assert down.status == 200 and down.body() == UPLOADED.encode()
    assert "attachment" in down.headers["content-disposition"]
    _shot(page, tmp_path, "jupyterlab-workspace.png")
    run(original, 5, edited)

    # A gateway error, as a notification with the gateway's own message: four files are two
    # more than this gateway's checkpoints may hold.
    run(original, 6)
    panel_tab = page.locator('.jp-SideBar.jp-mod-right .lm-TabBar-tab[data-id="sandgate-sandbox-panel"]')
    if not panel.is_visible():
        panel_tab.click()
    panel.locator('.sg-Panel-checkpointRow button[data-command="sandgate:checkpoint"]').click()
    toast = page.locator(".Toastify__toast", has_text="Checkpoint failed")
    expect(toast).to_contain_text("the workspace holds 4 files", timeout=2 * T)
    # Lab cuts a toast short: the whole message is behind its Details button.
    toast.get_by_text("Details").click()
    expect(page.locator(".jp-Dialog-body")).to_contain_text(
        "a checkpoint holds at most 2 (SANDGATE_CHECKPOINT_MAX_FILES)", timeout=T)
    page.keyboard.press("Escape")
    expect(page.locator(".jp-Dialog")).to_have_count(0, timeout=T)

    # The server part passes the gateway's status and message on, and reaches only this
    # Lab's kernels.
    bogus = str(uuid.uuid4())
    direct = gateway.request("POST", f"/api/sandboxes/{kid}/fork", {"checkpoint": bogus})
    proxied = page.request.post(f"{base}/sandgate/api/kernels/{kid}/fork", headers=auth,
                                data=json.dumps({"checkpoint": bogus}))
    assert direct.status == proxied.status == 404
    assert proxied.json()["message"] == direct.json()["message"], (proxied.json(), direct.json())
    other = gateway.request("POST", "/api/sandboxes", {}).json()["id"]
    try:
        stranger = page.request.get(f"{base}/sandgate/api/kernels/{other}", headers=auth)
        assert stranger.status == 404 and "not one of this Lab server's kernels" in stranger.json()["message"]
    finally:
        gateway.request("DELETE", f"/api/sandboxes/{other}")

    # A kernel deleted behind Lab's back: its panel says so.
    assert gateway.request("DELETE", f"/api/kernels/{fork_id}").status == 204
    activate(forked)
    expect(panel.locator(".sg-Panel-stale")).to_contain_text("no longer exists", timeout=T)
