"""What is particular to the qemu microVM driver (TCG here): its own kernel,
no network, the KVM trial boot, and the faults only a VM has. The behaviour
every driver shares is in test_drivers.py."""

import asyncio
import concurrent.futures
import json
import os
import tempfile
from pathlib import Path
import time

import psutil
import pytest

from conftest import Gateway, wait_for
from sandgate.config import Settings
from sandgate.drivers import qemu
from sandgate.drivers.base import Limits, SandboxError, SandboxSpec, socket_dir, tag
from sandgate.drivers.qemu import QemuDriver


@pytest.fixture(scope="module")
def image(home):
    from sandgate_images import vm

    return vm.build(home)  # shared with the other gateways, like the root image


def failed_with(r, words: str) -> bool:
    """The sandbox could not start or resume, for the reason ``words`` name: a
    runtime failure, 503 "unavailable" in the core's taxonomy (500 before it)."""
    return r.status == 503 and words in r.json()["message"]


def vm_gateway(home, tmp, **env):
    return Gateway(home, tmp, env={"SANDGATE_WARM_START": "false", **env})


def qemu_processes(gw):
    marker = str(gw.home / "sandboxes")
    return [p for p in psutil.process_iter(["cmdline"])
            if any(marker in a for a in (p.info["cmdline"] or [])) and "qemu" in (p.info["cmdline"] or [""])[0]]


@pytest.fixture(scope="module")
def vmgw(image, home, tmp_path_factory):
    g = vm_gateway(home, tmp_path_factory.mktemp("vm"))
    yield g
    g.stop()


def test_qemu_is_available_here():
    ok, why = QemuDriver.probe(Settings())
    assert ok, why


def test_microvm_kernel_has_its_own_kernel_and_no_network(vmgw):
    assert "python3-qemu" in vmgw.request("GET", "/api/kernelspecs").json()["kernelspecs"]
    r = vmgw.request("POST", "/api/kernels", {"name": "python3-qemu"})
    assert r.status == 201, r.body
    k = r.json()
    assert k["driver"] == "qemu"
    c = vmgw.connect(k["id"])
    out = c.execute("import os, platform\nprint(os.getuid(), platform.release())")
    uid, release = out["stdout"].split()
    assert uid == "1000" and "cloud" in release  # its own (Debian cloud) kernel
    out = c.execute("import socket\ns = socket.socket(); s.settimeout(2)\ntry:\n    s.connect(('1.1.1.1', 53)); print('net')\nexcept OSError as e:\n    print('no network')")
    assert out["stdout"] == "no network\n"
    out = c.execute("print(sorted(os.listdir('/sys/class/net')))")
    assert out["stdout"] == "['lo']\n"  # no network device at all, not just no route
    c.close()
    assert vmgw.request("DELETE", f"/api/kernels/{k['id']}").status == 204
    assert qemu_processes(vmgw) == []


def test_a_cold_boot_gets_its_env(vmgw):
    """A VM boots from a shared image, so its env can only come in `setup`."""
    r = vmgw.request("POST", "/api/sandboxes", {"driver": "qemu", "env": {"KERNEL_GREETING": "hi there"}})
    assert r.status == 201, r.body
    sid = r.json()["id"]
    try:
        out = vmgw.request("POST", f"/api/sandboxes/{sid}/execute", {"code": (
            "import os, subprocess\nprint(os.environ.get('KERNEL_GREETING'))\n"
            "print(subprocess.run(['sh', '-c', 'echo $KERNEL_GREETING'], capture_output=True, text=True).stdout.strip())")}).json()
        assert out["stdout"] == "hi there\nhi there\n", out
    finally:
        vmgw.request("DELETE", f"/api/sandboxes/{sid}")


def test_a_restore_with_other_memory_or_cpus_is_refused_by_name(tmp_path):
    """A migration restores only into a VM of the shape it was saved from
    (vm.json): other limits are refused before anything starts, and
    restore_compatible() tells the caller (the template is skipped then)."""
    driver = QemuDriver(str(tmp_path / "runtime" / "qemu"), Settings())
    image = tmp_path / "checkpoint"
    image.mkdir()
    (image / "vm.json").write_text(json.dumps({"memory_mb": 1024, "cpus": 1, "accel": "tcg", "vsock": False,
                                               "image": "/nonexistent", "agent": "/nonexistent"}))

    def spec(**limits):
        return SandboxSpec(id="sg-refused", rootfs=tmp_path, agent_dir=tmp_path, workspace=tmp_path / "ws",
                           state_dir=tmp_path / "state", limits=Limits(**limits))

    assert driver.restore_compatible(spec(), image) is None
    assert driver.restore_compatible(spec(cpus=1.5), image) is None  # one vCPU either way
    for limits, asked in (({"memory_mb": 256}, "256 MB"), ({"cpus": 2}, "2 vCPU")):
        why = driver.restore_compatible(spec(**limits), image)
        assert why and "1024 MB" in why and asked in why, why
        with pytest.raises(SandboxError) as e:
            asyncio.run(driver.restore(spec(**limits), image))
        assert str(e.value) == why
    assert not (tmp_path / "state").exists() and not (tmp_path / "ws").exists()  # nothing was started
    assert "damaged" in driver.restore_compatible(spec(), tmp_path / "nowhere")


def test_a_checkpoint_is_disk_deltas_and_missing_overlay_is_a_clear_error(vmgw):
    sid = vmgw.request("POST", "/api/sandboxes", {"driver": "qemu"}).json()["id"]
    vmgw.request("POST", f"/api/sandboxes/{sid}/execute", {"code": "y = 7\nopen('w.txt', 'w').write('kept')"})
    cp = vmgw.request("POST", f"/api/sandboxes/{sid}/checkpoints", {}).json()
    state = vmgw.home / "checkpoints" / "items" / cp["id"] / "state"
    # state.mig is kept as shared chunks (state_chunks.py); the disks whole: later disks' backing files.
    assert sorted(p.name for p in state.iterdir()) == ["chunks.json", "root.qcow2", "vm.json", "workspace.qcow2"]
    # The live VM's workspace disk is a new overlay whose backing file is the checkpoint's.
    ws = vmgw.home / "workspaces" / sid / "workspace.qcow2"
    assert ws.exists() and str(state / "workspace.qcow2") in os.popen(f"qemu-img info -U {ws}").read()
    (state / "workspace.qcow2").rename(state / "moved")
    r = vmgw.request("POST", f"/api/sandboxes/{sid}/fork", {"checkpoint": cp["id"]})
    assert failed_with(r, "workspace.qcow2 missing"), r.body
    (state / "moved").rename(state / "workspace.qcow2")
    out = vmgw.request("POST", f"/api/sandboxes/{sid}/execute", {"code": "print(y, open('w.txt').read())"}).json()
    assert out["stdout"] == "7 kept\n"  # the source is unharmed
    assert vmgw.request("DELETE", f"/api/sandboxes/{sid}").status == 204
    assert len(vmgw.request("GET", "/api/sandboxes").json()) == 0
    assert qemu_processes(vmgw) == [] and not any((vmgw.home / "sandboxes").iterdir())


def test_a_second_checkpoint_stores_a_fraction_of_the_vms_state(vmgw):
    sid = vmgw.request("POST", "/api/sandboxes", {"driver": "qemu"}).json()["id"]
    run = lambda s, code: vmgw.request("POST", f"/api/sandboxes/{s}/execute", {"code": code, "timeout": 120}).json()
    run(sid, "x = 41")
    cp1 = vmgw.request("POST", f"/api/sandboxes/{sid}/checkpoints", {}).json()
    assert run(sid, "x += 1; print(x)")["stdout"] == "42\n"
    cp2 = vmgw.request("POST", f"/api/sandboxes/{sid}/checkpoints", {}).json()
    assert cp2["state_bytes"] > 4 << 20 and cp2["stored_bytes"] < 0.25 * cp2["state_bytes"], (cp1, cp2)
    for cp, want in ((cp1, "41"), (cp2, "42")):
        r = vmgw.request("POST", f"/api/sandboxes/{sid}/fork", {"checkpoint": cp["id"]})
        assert r.status == 201, r.body
        assert run(r.json()["id"], "print(x)")["stdout"] == want + "\n"
        assert vmgw.request("DELETE", f"/api/sandboxes/{r.json()['id']}").status == 204
    assert vmgw.request("DELETE", f"/api/sandboxes/{sid}").status == 204


def test_a_paused_vm_whose_overlay_is_gone_reports_why(vmgw):
    sid = vmgw.request("POST", "/api/sandboxes", {"driver": "qemu"}).json()["id"]
    vmgw.request("POST", f"/api/sandboxes/{sid}/execute", {"code": "z = 1"})
    assert vmgw.request("POST", f"/api/sandboxes/{sid}/pause", {}).json()["state"] == "paused"
    (vmgw.home / "paused" / sid / "root.qcow2").unlink()
    for _ in range(2):  # each call tries again, and says why it cannot
        r = vmgw.request("POST", f"/api/sandboxes/{sid}/execute", {"code": "print(z)"})
        assert failed_with(r, "root.qcow2 missing"), r.body
        info = vmgw.request("GET", f"/api/sandboxes/{sid}").json()
        assert info["state"] == "paused" and "root.qcow2 missing" in info["reason"], info
        assert qemu_processes(vmgw) == [] and not list(Path(tempfile.gettempdir()).glob(
            f"sgq-{tag(str(vmgw.home))}-*"))  # no VM, no sockets
    assert (vmgw.home / "paused" / sid / "workspace.qcow2").exists()  # what is left of the image stays
    assert vmgw.request("GET", "/api").status == 200
    assert vmgw.request("DELETE", f"/api/sandboxes/{sid}").status == 204
    assert not (vmgw.home / "paused" / sid).exists() and not (vmgw.home / "workspaces" / sid).exists()


def test_a_failed_resume_loses_nothing_and_answers_waiting_clients(vmgw):
    sid = vmgw.request("POST", "/api/sandboxes", {"driver": "qemu"}).json()["id"]
    vmgw.request("POST", f"/api/sandboxes/{sid}/execute", {"code": "w = 5\nopen('f.txt', 'w').write('on disk')"})
    assert vmgw.request("POST", f"/api/sandboxes/{sid}/pause", {}).json()["state"] == "paused"
    image = vmgw.home / "paused" / sid
    state = (image / "state.mig").read_bytes()
    (image / "state.mig").write_bytes(state[:4096])  # qemu starts, then fails to load the VM's state
    # The resume moved the overlays out of the image before qemu failed: they must be back.
    r = vmgw.request("POST", f"/api/sandboxes/{sid}/execute", {"code": "print(w)"})
    assert failed_with(r, "restoring the VM's state failed"), r.body
    assert sorted(p.name for p in image.iterdir()) == ["root.qcow2", "state.mig", "vm.json", "workspace.qcow2"]
    assert vmgw.request("GET", f"/api/sandboxes/{sid}").json()["state"] == "paused"
    # A Jupyter client whose message wakes the paused kernel gets an error reply, not silence.
    c = vmgw.connect(sid)
    out = c.execute("print(w)", timeout=120)
    assert out["reply"]["status"] == "error" and "could not be resumed" in out["reply"]["evalue"], out["reply"]
    c.close()
    assert qemu_processes(vmgw) == []
    (image / "state.mig").write_bytes(state)  # repaired: the next call resumes it, all of it
    out = vmgw.request("POST", f"/api/sandboxes/{sid}/execute", {"code": "print(w, open('f.txt').read())"}).json()
    assert out["stdout"] == "5 on disk\n", out
    assert vmgw.request("DELETE", f"/api/sandboxes/{sid}").status == 204


def test_a_restart_finds_the_workspace_disk_in_the_newest_checkpoint(vmgw):
    """A checkpoint takes a VM's workspace disk with it; if the sandbox dies
    before it carries on from the checkpoint (a failed restore), the disk
    exists only there, and a restart must start from it, not from empty."""
    sid = vmgw.request("POST", "/api/sandboxes", {"driver": "qemu"}).json()["id"]
    vmgw.request("POST", f"/api/sandboxes/{sid}/execute", {"code": "open('kept.txt', 'w').write('in the checkpoint')"})
    assert vmgw.request("POST", f"/api/sandboxes/{sid}/checkpoints", {}).status == 201
    for p in qemu_processes(vmgw):
        p.kill()
    wait_for(lambda: vmgw.request("GET", f"/api/sandboxes/{sid}").json()["state"] == "dead", timeout=60)
    (vmgw.home / "workspaces" / sid / "workspace.qcow2").unlink()  # as after a restore that failed
    assert vmgw.request("POST", f"/api/kernels/{sid}/restart").status == 200
    out = vmgw.request("POST", f"/api/sandboxes/{sid}/execute", {"code": "print(open('kept.txt').read())"}).json()
    assert out["stdout"] == "in the checkpoint\n", out
    assert vmgw.request("DELETE", f"/api/sandboxes/{sid}").status == 204


def test_guest_kernel_panic_is_reported_and_cleaned_up(image, home, tmp_path):
    # No init can be found: the guest kernel panics during boot.
    g = vm_gateway(home, tmp_path, SANDGATE_QEMU_APPEND="rdinit=/nonexistent")
    try:
        r = g.request("POST", "/api/sandboxes", {"driver": "qemu"})
        assert failed_with(r, "Kernel panic"), r.body
        assert g.request("GET", "/api").status == 200
        assert g.request("GET", "/api/sandboxes").json() == []
        assert qemu_processes(g) == [] and not any((g.home / "sandboxes").iterdir())
    finally:
        g.stop()


def test_a_guest_that_never_answers_times_out_and_is_cleaned_up(image, home, tmp_path):
    # The agent listens somewhere the gateway never looks: the guest runs, silent.
    g = vm_gateway(home, tmp_path, SANDGATE_QEMU_APPEND="sandgate.transport=unix:/tmp/elsewhere",
                   SANDGATE_KERNEL_START_TIMEOUT="8")
    try:
        t0 = time.monotonic()
        r = g.request("POST", "/api/sandboxes", {"driver": "qemu"})
        assert failed_with(r, "not ready within 8 s"), r.body
        assert time.monotonic() - t0 < 60
        assert qemu_processes(g) == [] and not any((g.home / "sandboxes").iterdir())
    finally:
        g.stop()


# A compromised guest owns its kernel: these replace the guest's init with a
# shell (busybox, from the initramfs) that does the hostile thing.
def hostile_init(script):
    return f'rdinit=/bin/busybox -- sh -c "cd /mods; {script}"'


MOUNT_DEV = "/bin/busybox mount -t devtmpfs d /dev"


def test_a_guest_flooding_its_console_is_bounded(image, home, tmp_path):
    flood = hostile_init(f"{MOUNT_DEV}; while :; do echo flooding the console {'x' * 200}; done >/dev/ttyS0")
    g = vm_gateway(home, tmp_path, SANDGATE_QEMU_APPEND=flood, SANDGATE_KERNEL_START_TIMEOUT="40")
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            create = pool.submit(g.request, "POST", "/api/sandboxes", {"driver": "qemu"})
            logs = lambda: list((g.home / "sandboxes").glob("*/console.log*"))  # noqa: E731
            wait_for(lambda: len(logs()) == 2, timeout=40)  # rotated: over 1 MiB written
            biggest = 0
            while not create.done():
                assert g.request("GET", "/api", timeout=5).status == 200  # responsive under the flood
                biggest = max(biggest, sum(p.stat().st_size for p in logs() if p.exists()))
                concurrent.futures.wait([create], timeout=0.5)  # the next sample, or the answer
            r = create.result()
        assert 1 << 20 < biggest <= (2 << 20) + (64 << 10), biggest
        assert failed_with(r, "not ready within 40 s"), r.body
        assert "flooding the console" in r.json()["message"]  # the reason carries the console's tail
        assert qemu_processes(g) == [] and not any((g.home / "sandboxes").iterdir())
    finally:
        g.stop()


def test_a_guest_writing_garbage_on_the_agent_stream_is_stopped(image, home, tmp_path):
    modules = "for m in virtio_ring virtio virtio_mmio virtio_console; do /bin/busybox insmod $m.ko; done"
    garbage = hostile_init(f"{modules}; {MOUNT_DEV}; /bin/busybox sleep 1; "
                           "for p in /dev/vport*; do /bin/busybox cat /dev/urandom >$p; done")
    g = vm_gateway(home, tmp_path, SANDGATE_QEMU_APPEND=garbage)
    try:
        r = g.request("POST", "/api/sandboxes", {"driver": "qemu"})
        assert failed_with(r, "protocol error from agent"), r.body
        assert g.request("GET", "/api/sandboxes").json() == []
        assert qemu_processes(g) == [] and not any((g.home / "sandboxes").iterdir())
    finally:
        g.stop()


def test_vms_left_by_a_killed_gateway_are_adopted_or_else_reaped(image, home, tmp_path):
    g = vm_gateway(home, tmp_path)
    own = g.home
    kept, lost = (g.request("POST", "/api/sandboxes", {"driver": "qemu"}).json() for _ in range(2))
    by_pid = {p.pid: p for p in qemu_processes(g)}
    assert len(by_pid) == 2
    g.proc.kill()
    g.proc.wait()
    assert all(p.is_running() for p in by_pid.values())  # the VMs outlived their gateway
    # One VM's handle is gone: the next gateway cannot adopt it, so it kills it.
    handle = socket_dir(own, lost["runtime_id"], "q") / "handle.json"
    lost_pid = json.loads(handle.read_text())["pid"]
    handle.unlink()
    g2 = Gateway(home, tmp_path, own_home=own, env={"SANDGATE_WARM_START": "false"})
    try:
        by_pid[lost_pid].wait(30)
        assert [p.pid for p in qemu_processes(g2)] == [p for p in by_pid if p != lost_pid]
        assert g2.request("GET", f"/api/sandboxes/{kept['id']}").json()["state"] == "running"
        dead = g2.request("GET", f"/api/sandboxes/{lost['id']}").json()
        assert dead["state"] == "dead" and "no checkpoint" in dead["reason"], dead
        assert not socket_dir(own, lost["runtime_id"], "q").exists()
        assert g2.request("DELETE", f"/api/sandboxes/{kept['id']}").status == 204
        assert qemu_processes(g2) == []
    finally:
        g2.stop()


def test_kvm_is_chosen_by_a_trial_boot_and_remembered(image, tmp_path):
    first, why = qemu.accel(tmp_path, image)
    assert first in ("kvm", "tcg") and why
    if os.path.exists("/dev/kvm"):
        saved = json.loads((tmp_path / "images" / "qemu-accel.json").read_text())
        assert saved["accel"] == first
        t0 = time.monotonic()
        again, why2 = qemu.accel(tmp_path, image)
        assert again == first and "remembered" in why2 and time.monotonic() - t0 < 1
    assert qemu.accel(tmp_path, image, forced="tcg") == ("tcg", "set by SANDGATE_QEMU_ACCEL")
