"""JupyterLab in a real browser (Debian's chromium, driven by playwright) against
Sandgate through `jupyter lab --gateway-url`: a matplotlib plot renders, a running
cell is interrupted, the kernel restarts (without a "kernel died" dialog), Lab
reconnects, and a screenshot is kept: jupyterlab.png in the test's tmp dir, also
copied to docs/images/jupyterlab.png with SANDGATE_DOCS_SCREENSHOT=1."""

import base64
import json
import os
import re
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import nbformat
import pytest
from playwright.sync_api import expect, sync_playwright

from conftest import free_port, wait_for

CHROMIUM = "/usr/bin/chromium"
# Every wait on the page, in ms: generous, since CI shares two cores with the sandboxes.
T = 60_000
DOCS_IMAGE = Path(__file__).resolve().parent.parent / "docs" / "images" / "jupyterlab.png"

CELLS = [
    "marker = 'defined before the restart'\nprint(marker)",
    "%matplotlib inline\nimport matplotlib.pyplot as plt\nimport numpy as np\n"
    "x = np.linspace(0, 4 * np.pi, 400)\n"
    "fig, ax = plt.subplots(figsize=(6, 3))\n"
    "ax.plot(x, np.sin(x), label='sin')\nax.plot(x, np.cos(x), label='cos')\n"
    "ax.set_title('drawn in a Sandgate sandbox')\nax.legend()\nplt.show()",
    "import time\ntime.sleep(600)",
    "print('marker' in globals())",
]


@pytest.fixture
def lab(gateway, tmp_path):
    """`jupyter lab --gateway-url` on a free port, its root a directory holding nb.ipynb."""
    root = tmp_path / "root"
    root.mkdir()
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (gVisor sandbox)", "language": "python"}
    nbformat.write(nb, root / "nb.ipynb")
    # No "would you like to get Jupyter news?" toast over the notebook, and no request for it.
    settings = tmp_path / "settings"
    (settings / "@jupyterlab" / "apputils-extension").mkdir(parents=True)
    (settings / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings").write_text(
        json.dumps({"fetchNews": "false", "checkForUpdates": False}))
    port = free_port()
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(tmp_path / "cfg"), "JUPYTER_DATA_DIR": str(tmp_path / "data"),
           "JUPYTER_RUNTIME_DIR": str(tmp_path / "rt"),
           # JupyterLab keeps workspaces (open tabs, layout) here: none from an earlier run.
           "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "ws"), "JUPYTERLAB_SETTINGS_DIR": str(settings)}
    log = open(tmp_path / "jupyterlab.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root", f"--port={port}", "--ip=127.0.0.1",
         f"--ServerApp.root_dir={root}", "--IdentityProvider.token=jtok",
         f"--gateway-url={gateway.url}", f"--GatewayClient.auth_token={gateway.token}",
         "--GatewayClient.request_timeout=120"],
        env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"

    def up():
        try:
            with urllib.request.urlopen(f"{base}/api/status?token=jtok", timeout=5) as r:
                return r.status == 200
        except OSError:
            return proc.poll() is not None  # exited: stop waiting, the assert below says why

    try:
        wait_for(up, timeout=90)
        assert proc.poll() is None, (tmp_path / "jupyterlab.log").read_text()
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def test_jupyterlab_in_chromium(gateway, lab, tmp_path):
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True)
        page = browser.new_page(viewport={"width": 1280, "height": 1000})
        try:
            _drive(gateway, page, lab, tmp_path)
        except BaseException:
            page.screenshot(path=str(tmp_path / "failure.png"))
            (tmp_path / "failure.html").write_text(page.content())
            raise
        finally:
            browser.close()


def _drive(gateway, page, base, tmp_path):
    page.set_default_timeout(T)
    page.goto(f"{base}/lab/tree/nb.ipynb?token=jtok")
    cells = page.locator(".jp-NotebookPanel .jp-Notebook .jp-Cell")
    expect(cells).to_have_count(len(CELLS), timeout=2 * T)
    status = page.locator(".jp-NotebookPanel-toolbar [data-jp-item-name=executionProgress] .jp-Notebook-ExecutionIndicator")
    # The session's kernel started in the gateway and Lab is connected to it. The indicator
    # also reads "idle" before Lab has asked for a kernel, so the gateway's list comes first.
    kernels = wait_for(lambda: gateway.request("GET", "/api/kernels").json(), timeout=2 * T / 1000)
    assert len(kernels) == 1, kernels
    expect(status).to_have_attribute("data-status", "idle", timeout=2 * T)
    kid = kernels[0]["id"]
    # Lab's server lists the gateway's kernels as its own.
    listed = page.request.get(f"{base}/api/kernels", headers={"Authorization": "token jtok"}).json()
    assert [k["id"] for k in listed] == [kid], listed
    # Every dialog Lab opens, by its label.
    page.evaluate("""() => {
        window.dialogs = [];
        new MutationObserver(records => records.forEach(r => r.addedNodes.forEach(n => {
            if (n.classList && n.classList.contains("jp-Dialog")) window.dialogs.push(n.getAttribute("aria-label"));
        }))).observe(document.body, {childList: true});
    }""")
    # Hide the file browser: more room for the notebook in the screenshot.
    page.keyboard.press("Control+b")
    # Lab's own file browser by its id: with Sandgate installed, the Sandgate extension's
    # workspace browser is a .jp-FileBrowser too.
    expect(page.locator("#filebrowser")).to_be_hidden(timeout=T)

    def run(i):
        cells.nth(i).locator(".jp-InputPrompt").click()
        expect(cells.nth(i)).to_have_class(re.compile(r"\bjp-mod-selected\b"), timeout=T)
        page.locator('jp-button[data-command="notebook:run-cell-and-select-next"]').click()

    def output(i):
        return cells.nth(i).locator(".jp-OutputArea-output")

    run(0)
    expect(output(0)).to_have_text("defined before the restart", timeout=T)
    expect(cells.nth(0).locator(".jp-InputPrompt")).to_have_text("[1]:", timeout=T)

    # A matplotlib plot: a PNG rendered as an <img> in the output area.
    run(1)
    img = output(1).locator("img")
    expect(img).to_be_visible(timeout=T)
    src = img.get_attribute("src")
    assert src.startswith("data:image/png;base64,"), src[:60]
    png = base64.b64decode(src.split(",", 1)[1])
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000, len(png)
    # The browser decoded it, at the figure's size (6 x 3 inches).
    width, height = img.evaluate("i => [i.naturalWidth, i.naturalHeight]")
    assert width > 300 and 1.5 < width / height < 2.5, (width, height)

    # A cell that would run for ten minutes, interrupted from the toolbar.
    run(2)
    expect(cells.nth(2).locator(".jp-InputPrompt")).to_have_text("[*]:", timeout=T)
    expect(status).to_have_attribute("data-status", "busy", timeout=T)
    page.locator('jp-button[data-command="notebook:interrupt-kernel"]').click()
    expect(output(2)).to_contain_text("KeyboardInterrupt", timeout=T)
    expect(status).to_have_attribute("data-status", "idle", timeout=T)
    expect(cells.nth(2).locator(".jp-InputPrompt")).to_have_text("[3]:", timeout=T)

    # Restart from the toolbar, confirming the dialog.
    page.locator('jp-button[data-command="notebook:restart-kernel"]').click()
    page.locator(".jp-Dialog .jp-Dialog-button.jp-mod-accept").click()
    expect(page.locator(".jp-Dialog")).to_have_count(0, timeout=T)
    wait_for(lambda: f"sandbox {kid}: restarting -> running" in gateway.log_text(), timeout=120)
    expect(status).to_have_attribute("data-status", "idle", timeout=T)
    # Only the confirmation: no "kernel appears to have died" (what an iopub "restarting"
    # status would bring up, see Sandbox.restart).
    dialogs = page.evaluate("window.dialogs")
    assert len(dialogs) == 1 and dialogs[0].startswith("Restart Kernel?"), dialogs
    # The same kernel in the gateway, with a fresh interpreter: the variable is gone.
    assert [k["id"] for k in gateway.request("GET", "/api/kernels").json()] == [kid]

    # Kernel > Reconnect to Kernel: a new websocket, through jupyter_server to the gateway.
    # (Lab then shows "unknown" until the next cell: it ignores the status messages of its own
    # kernel_info_request, the untracked_message_types jupyterlab_server gives it; it does the
    # same with a local kernel.)
    page.locator(".lm-MenuBar-item", has_text="Kernel").click()
    with page.expect_websocket(lambda ws: f"/api/kernels/{kid}/channels" in ws.url, timeout=T):
        page.locator('.lm-Menu-item[data-command="kernelmenu:reconnect-to-kernel"]').click()
    # After a restart and a reconnect: a fresh interpreter, so the variable is gone.
    run(3)
    expect(output(3)).to_have_text("False", timeout=T)
    expect(cells.nth(3).locator(".jp-InputPrompt")).to_have_text("[1]:", timeout=T)
    expect(status).to_have_attribute("data-status", "idle", timeout=T)

    # The plot is still on the page: keep a screenshot of it, from the top of the notebook.
    cells.nth(0).scroll_into_view_if_needed()
    expect(img).to_be_in_viewport(timeout=T)
    shot = tmp_path / "jupyterlab.png"
    page.screenshot(path=str(shot))
    assert shot.stat().st_size > 20_000
    if os.environ.get("SANDGATE_DOCS_SCREENSHOT"):
        DOCS_IMAGE.parent.mkdir(exist_ok=True)
        shutil.copyfile(shot, DOCS_IMAGE)
