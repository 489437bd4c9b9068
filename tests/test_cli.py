"""The command line: serve's token and settings, doctor, idle culling."""

import json
import os
import subprocess
import sys
import time
from datetime import datetime

from conftest import Gateway, free_port, wait_for


def sandgate(*args, env=None, timeout=60):
    return subprocess.run([sys.executable, "-m", "sandgate.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL)


def test_doctor_reports_this_host():
    r = sandgate("doctor", "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["driver gvisor"]["ok"] is True
    assert set(report) >= {"qemu", "kvm", "vsock", "mmdebstrap", "image", "cgroups"}
    assert report["vsock"]["ok"] == os.path.exists("/dev/vhost-vsock")
    text = sandgate("doctor").stdout
    assert "driver gvisor" in text and "kvm" in text


def test_serve_generates_and_prints_a_token(home, tmp_path):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "SANDGATE_TOKEN"}
    own = tmp_path / "home"
    own.mkdir()
    (own / "images").symlink_to(home / "images")
    proc = subprocess.Popen([sys.executable, "-m", "sandgate.cli", "serve", "--port", str(port), "--home", str(own)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        lines = []
        while not any(line.startswith("Token (generated):") for line in lines):
            line = proc.stdout.readline()
            assert line, "".join(lines)
            lines.append(line)
        token = [line for line in lines if line.startswith("Token")][0].split(":", 1)[1].strip()
        assert len(token) >= 24
        gw = Gateway.__new__(Gateway)
        gw.url, gw.token = f"http://127.0.0.1:{port}", token
        assert gw.request("GET", "/api/kernels").status == 200
        assert gw.request("GET", "/api/kernels", token="nope").status == 401
        # A second gateway on the same home would reclaim this one's sandboxes: refused.
        second = sandgate("serve", "--port", str(free_port()), "--home", str(own), env={"SANDGATE_TOKEN": "t"})
        assert second.returncode == 1 and "another gateway is running with home" in second.stderr
    finally:
        proc.terminate()
        proc.wait(30)


def test_bad_settings_are_refused_clearly():
    r = sandgate("serve", "--port", "70000")
    assert r.returncode != 0 and "invalid setting: port" in r.stderr
    r = sandgate("serve", env={"SANDGATE_MAX_KERNELS": "lots"})
    assert r.returncode != 0 and "max_kernels" in r.stderr
    r = sandgate("serve", "--driver", "nonesuch", "--port", str(free_port()), env={"SANDGATE_TOKEN": "t"})
    assert r.returncode != 0 and "default driver 'nonesuch' is not available" in r.stderr


def test_idle_kernels_are_culled(home, tmp_path):
    gw = Gateway(home, tmp_path, env={"SANDGATE_CULL_IDLE_TIMEOUT": "2", "SANDGATE_CULL_INTERVAL": "1"})
    try:
        idle = gw.start_kernel()
        busy = gw.start_kernel()
        c = gw.connect(busy)  # a connected kernel is never culled
        wait_for(lambda: gw.request("GET", f"/api/kernels/{idle}").status == 404, timeout=30)
        # The connected one is idle past the timeout too, and two whole passes of the culler later it is there.
        last = gw.request("GET", f"/api/kernels/{busy}").json()["last_activity"]
        wait_for(lambda: time.time() > datetime.fromisoformat(last.replace("Z", "+00:00")).timestamp() + 2)
        passes = lambda: gw.metrics()[("sandgate_culler_passes_total", ())]  # noqa: E731
        after = passes()
        wait_for(lambda: passes() >= after + 2, timeout=30)
        assert gw.request("GET", f"/api/kernels/{busy}").status == 200
        assert c.execute("1")["results"]
        assert "culling sandbox" in gw.log_text()
        c.close()
    finally:
        gw.stop()
