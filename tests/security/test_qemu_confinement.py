"""qemu as root with every capability, no seccomp filter, in the gateway's
cgroup, and a guest whose user namespaces give the kernel's user every
capability over its own namespaces, would leave little between a guest escape
and the host. So a VM's qemu runs under its seccomp filter, as a uid of its own that
no account has, with no capabilities, in a cgroup of its own holding the
sandbox's limits; the guest's init turns user namespaces off and sets
no_new_privs for everything it starts.

Real qemu (TCG here) through a real gateway, as tests/test_qemu.py runs it."""

import grp
import os
import pwd
from pathlib import Path

import psutil
import pytest

from conftest import Gateway
from sandgate.config import Settings
from sandgate.drivers import qemu

pytestmark = [
    pytest.mark.skipif(not qemu.QemuDriver.probe(Settings())[0], reason="qemu is not installed"),
    pytest.mark.skipif(os.geteuid() != 0, reason="confining qemu (its uid, its cgroup) needs a root gateway"),
]


@pytest.fixture(scope="module")
def vmgw(home, tmp_path_factory):
    from sandgate_images import vm

    vm.build(home)
    g = Gateway(home, tmp_path_factory.mktemp("qemu-confined"), env={"SANDGATE_WARM_START": "false"})
    yield g
    g.stop()


def create(gw, **limits) -> str:
    r = gw.request("POST", "/api/sandboxes", {"driver": "qemu", **({"limits": limits} if limits else {})})
    assert r.status == 201, r.body
    return r.json()["id"]


def run(gw, sid, code) -> str:
    r = gw.request("POST", f"/api/sandboxes/{sid}/execute", {"code": code})
    assert r.status == 200 and r.json()["status"] == "ok", r.body
    return r.json()["stdout"]


def vm_process(gw, sid) -> psutil.Process:
    """The sandbox's qemu: its command line names the sandbox's directory."""
    marker = str(gw.home / "sandboxes" / sid) + "/"
    found = [p for p in psutil.process_iter(["cmdline"])
             if "qemu" in (p.info["cmdline"] or [""])[0] and any(marker in a for a in p.info["cmdline"])]
    assert len(found) == 1, found
    return found[0]


def status(pid) -> dict:
    return {k: v.split() for k, v in (line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())}


def cgroups(pid) -> dict:
    """controller -> cgroup path ("" for the v2 hierarchy)."""
    out = {}
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for c in controllers.split(","):
            out[c] = path
    return out


def test_qemu_runs_as_a_uid_of_its_own_without_capabilities_under_seccomp(vmgw):
    a, b = create(vmgw), create(vmgw)
    try:
        st = status(vm_process(vmgw, a).pid)
        uids, gids = {int(u) for u in st["Uid"]}, {int(g) for g in st["Gid"]}
        assert len(uids) == 1 and 0 not in uids, st["Uid"]  # real, effective, saved and fs uid alike
        uid = uids.pop()
        with pytest.raises(KeyError):
            pwd.getpwuid(uid)  # not an account's (not even nobody's)
        assert gids == {uid}
        with pytest.raises(KeyError):
            grp.getgrgid(uid)
        assert st["Groups"] == [str(uid)]
        assert int(st["CapEff"][0], 16) == 0 and int(st["CapPrm"][0], 16) == 0, st
        assert st["Seccomp"] == ["2"], st  # a filter, qemu's -sandbox
        assert st["NoNewPrivs"] == ["1"], st
        # Each VM its own uid: one qemu cannot signal another.
        assert int(status(vm_process(vmgw, b).pid)["Uid"][0]) != uid
        assert run(vmgw, a, "print(1 + 1)") == "2\n"  # and the VM works as before
    finally:
        for s in (a, b):
            vmgw.request("DELETE", f"/api/sandboxes/{s}")


def test_qemu_runs_in_a_cgroup_of_its_own_with_the_sandboxs_limits(vmgw):
    sid = create(vmgw, memory_mb=384, cpus=1.5)
    dirs = []
    try:
        p = vm_process(vmgw, sid)
        groups = cgroups(p.pid)
        root = Path("/sys/fs/cgroup")
        v2 = (root / "cgroup.controllers").exists()
        for c in [""] if v2 else ["memory", "cpu", "pids"]:
            assert groups[c].startswith("/sandgate-qemu/") and sid in groups[c], groups
        argv = p.cmdline()
        accel = argv[argv.index("-accel") + 1].split(",")[0]  # tcg here: qemu's translated code counts too
        expected_memory = (384 + qemu.OVERHEAD_MB[accel]) << 20
        if v2:
            path = groups[""]
            d = root / path.lstrip("/")
            assert int((d / "memory.max").read_text()) == expected_memory
            assert (d / "cpu.max").read_text().split() == ["150000", "100000"]
            assert int((d / "pids.max").read_text()) == qemu.VM_PIDS
            dirs = [d]
        else:
            mem, cpu, pids = (root / c / groups[c].lstrip("/") for c in ("memory", "cpu", "pids"))
            assert int((mem / "memory.limit_in_bytes").read_text()) == expected_memory
            assert int((cpu / "cpu.cfs_quota_us").read_text()) == 150000
            assert int((cpu / "cpu.cfs_period_us").read_text()) == 100000
            assert int((pids / "pids.max").read_text()) == qemu.VM_PIDS
            dirs = [mem, cpu, pids]
        assert all(str(p.pid) in (d / "cgroup.procs").read_text().split() for d in dirs)
    finally:
        assert vmgw.request("DELETE", f"/api/sandboxes/{sid}").status == 204
    assert not any(d.exists() for d in dirs)  # removed with the VM


def test_the_guest_kernel_has_no_user_namespaces_and_no_new_privileges(vmgw):
    sid = create(vmgw)
    try:
        out = run(vmgw, sid, "import subprocess\n"
                             "r = subprocess.run(['unshare', '--user', '--map-root-user', 'id', '-u'], "
                             "capture_output=True, text=True)\n"
                             "print(r.returncode, repr(r.stdout.strip()))\n"
                             "print(open('/proc/sys/user/max_user_namespaces').read().strip())\n"
                             "print([l.split()[1] for l in open('/proc/self/status') if l.startswith('NoNewPrivs')])")
        unshare, max_ns, nnp = out.splitlines()
        assert unshare.split()[0] != "0" and "'0'" not in unshare, out  # no namespace, no root in one
        assert max_ns == "0", out
        assert nnp == "['1']", out
    finally:
        vmgw.request("DELETE", f"/api/sandboxes/{sid}")


def test_a_vm_gets_the_memory_and_cpus_asked_for_not_the_templates(vmgw):
    """A VM restored from the template would keep its -m 1024 whatever was asked. Limits other
    than the defaults boot cold (a restore needs the checkpoint's shape, and
    QemuDriver.restore_compatible refuses any other: tests/test_qemu.py)."""
    sid = create(vmgw, memory_mb=256, cpus=2)
    try:
        mem_mb, cpus = map(int, run(vmgw, sid, (
            "import os\nmem = next(int(l.split()[1]) for l in open('/proc/meminfo') if l.startswith('MemTotal:'))\n"
            "print(mem >> 10, os.cpu_count())")).split())
        assert 150 < mem_mb < 300 and cpus == 2  # -m 256 -smp 2, not the defaults (1024, 1)
    finally:
        assert vmgw.request("DELETE", f"/api/sandboxes/{sid}").status == 204
