"""The qemu microVM driver, under TCG here: a kernel in its own VM, reached
through the same Jupyter and sandbox APIs as a gVisor one."""

import pytest

from conftest import Gateway
from sandgate.drivers.qemu import QemuDriver


@pytest.fixture(scope="module")
def vmgw(home, tmp_path_factory):
    from sandgate_images import vm

    vm.build(home)  # shared with the other gateways, like the root image
    g = Gateway(home, tmp_path_factory.mktemp("vm"), env={"SANDGATE_WARM_START": "false"})
    yield g
    g.stop()


def test_qemu_is_available_here():
    ok, why = QemuDriver.probe()
    assert ok, why


def test_microvm_kernel_runs_cells_and_files(vmgw):
    assert "python3-qemu" in vmgw.request("GET", "/api/kernelspecs").json()["kernelspecs"]
    r = vmgw.request("POST", "/api/kernels", {"name": "python3-qemu"})
    assert r.status == 201, r.body
    k = r.json()
    assert k["driver"] == "qemu"
    c = vmgw.connect(k["id"])
    out = c.execute("import os, platform\nx = 41\nprint(x + 1, os.getuid(), platform.release())")
    value, uid, release = out["stdout"].split()
    assert value == "42" and uid == "1000" and "cloud" in release  # its own (Debian cloud) kernel
    out = c.execute("import socket\ns = socket.socket(); s.settimeout(2)\ntry:\n    s.connect(('1.1.1.1', 53)); print('net')\nexcept OSError as e:\n    print('no network')")
    assert out["stdout"] == "no network\n"
    c.close()
    assert vmgw.request("PUT", f"/api/sandboxes/{k['id']}/files/in.txt", raw=b"from the host").status == 201
    r = vmgw.request("POST", f"/api/sandboxes/{k['id']}/execute", {"code": "print(open('in.txt').read())"})
    assert r.json()["stdout"] == "from the host\n"
    # No running-state snapshots for VMs yet: a clear answer, and the VM is unharmed.
    r = vmgw.request("POST", f"/api/sandboxes/{k['id']}/checkpoints", {})
    assert r.status == 500 and "cannot checkpoint" in r.json()["message"]
    assert vmgw.request("POST", f"/api/sandboxes/{k['id']}/execute", {"code": "print(x)"}).json()["stdout"] == "41\n"
    assert vmgw.request("DELETE", f"/api/kernels/{k['id']}").status == 204
