"""The Firecracker driver.

Two kinds of tests:

* ``test_real_*``: the real firecracker binary on a KVM host, through a real
  gateway: boot, a cell, checkpoint and two forks. Skipped unless
  FIRECRACKER_BIN names a real Firecracker (docs/firecracker.md).
* ``test_fake_*``: the driver against tests/fake_firecracker.py, a stand-in
  binary that checks every API request against Firecracker's swagger
  definitions and runs the real guest agent as a host process behind the
  vsock CONNECT handshake. It cannot snapshot, so restores end in its refusal.
  These run everywhere.

Plus the vmlinux extraction, on the real Debian cloud kernel.
"""

from __future__ import annotations

import asyncio
import glob
import gzip
import json
import os
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from conftest import HOME, Gateway, wait_for
from sandgate.agent_link import AgentLink
from sandgate.config import Settings
from sandgate.drivers import DRIVERS
from sandgate.drivers.base import Limits, SandboxError, SandboxSpec
from fake_firecracker import DIFF_PAGES
from sandgate.drivers.firecracker import BOOT_ARGS, FirecrackerDriver, api_call, apply_diff, unix_connect
from sandgate_agent import protocol as P
from sandgate_images import vmlinux

FAKE = Path(__file__).with_name("fake_firecracker.py").resolve()
REAL_BIN = os.environ.get("FIRECRACKER_BIN", "")
real = pytest.mark.skipif(not REAL_BIN or Path(REAL_BIN).resolve() == FAKE,
                          reason="needs the real firecracker: set FIRECRACKER_BIN on a KVM host (docs/firecracker.md)")
needs_dev_kvm = pytest.mark.skipif(not os.path.exists("/dev/kvm"), reason="the driver's probe needs /dev/kvm")


# -- fixtures ----------------------------------------------------------------
@pytest.fixture(scope="session")
def debian_vmlinuz(tmp_path_factory) -> Path:
    """The real Debian cloud kernel (bzImage): from the VM image cache, else
    from the apt cache's .deb."""
    for p in sorted(glob.glob(str(HOME / "images" / "vm-*" / "vmlinuz"))):
        return Path(p)
    debs = sorted(glob.glob("/var/cache/apt/archives/linux-image-*-cloud-amd64*.deb"))
    debs = [d for d in debs if "linux-image-cloud-amd64_" not in d]  # the meta package has no kernel
    if not debs:
        pytest.skip("no Debian cloud kernel here (no VM image, no linux-image-*-cloud-amd64 .deb in the apt cache)")
    out = tmp_path_factory.mktemp("deb")
    subprocess.run(["dpkg-deb", "-x", debs[-1], str(out)], check=True)
    return next((out / "boot").glob("vmlinuz-*"))


@pytest.fixture(scope="session")
def fake_image(debian_vmlinuz, tmp_path_factory) -> Path:
    """A VM image directory for the fake: the real kernel (so the driver's
    vmlinux extraction runs for real), placeholder initrd and root disk, and
    a real empty ext4 workspace base."""
    d = tmp_path_factory.mktemp("fcimage")
    shutil.copy(debian_vmlinuz, d / "vmlinuz")
    (d / "initrd.gz").write_bytes(gzip.compress(b"not a real initramfs: the fake does not boot it"))
    for name, size in (("root.ext4", "64M"), ("workspace.ext4", "64M")):
        subprocess.run(["truncate", "-s", size, str(d / name)], check=True)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(d / "workspace.ext4")], check=True)
    return d


@pytest.fixture
def fake(fake_image, tmp_path, monkeypatch):
    """The environment the driver reads, pointing at the fake."""
    log = tmp_path / "requests.jsonl"
    monkeypatch.setenv("FIRECRACKER_BIN", str(FAKE))
    monkeypatch.setenv("SANDGATE_FIRECRACKER_IMAGE", str(fake_image))
    monkeypatch.setenv("FAKE_FIRECRACKER_LOG", str(log))
    monkeypatch.delenv("SANDGATE_FIRECRACKER_JAILER", raising=False)
    monkeypatch.delenv("FAKE_FIRECRACKER_FAIL", raising=False)
    return log


def requests(log: Path) -> list:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def calls(log: Path) -> list:
    return [f"{r['method']} {r['path']}" for r in requests(log)]


def new_spec(root: Path, n: str, memory_mb=256, cpus=2.0) -> SandboxSpec:
    return SandboxSpec(id=f"sg-{uuid.uuid4()}-{uuid.uuid4().hex[:6]}", rootfs=root / "unused-rootfs",
                       agent_dir=root / "unused-agent", workspace=root / "workspaces" / n,
                       state_dir=root / "sandboxes" / n, limits=Limits(memory_mb=memory_mb, cpus=cpus))


def driver_for(root: Path) -> FirecrackerDriver:
    return FirecrackerDriver(str(root / "home" / "runtime" / "firecracker"), Settings.load())  # as `fake` set it


async def read_ready(sb, timeout=90) -> P.EventFrame:
    frame, _ = await asyncio.wait_for(P.read_frame(sb.reader), timeout)
    assert isinstance(frame, P.EventFrame) and frame.event == "ready", frame
    return frame


async def ping(sb) -> dict:
    link = AgentLink(sb.reader, sb.writer, lambda ch, parts: None, lambda ev: None)
    try:
        result, _ = await link.request("ping", timeout=30)
        return result
    finally:
        await link.close()


def run(coro):
    return asyncio.run(coro)


# -- vmlinux -------------------------------------------------------------------
def test_vmlinux_extracted_from_the_debian_kernel(debian_vmlinuz, tmp_path):
    bz = tmp_path / "vmlinuz"
    shutil.copy(debian_vmlinuz, bz)
    assert bz.read_bytes()[0x202:0x206] == b"HdrS"  # it is a bzImage
    out = vmlinux.extract(bz)
    assert out == tmp_path / "vmlinux"
    head = out.read_bytes()[:20]
    assert head[:4] == b"\x7fELF" and head[4] == 2 and int.from_bytes(head[18:20], "little") == 62  # ELF64 x86-64
    assert vmlinux.compression(bz) == "lz4"  # what Debian's 6.1 cloud kernels use (CONFIG_KERNEL_LZ4)
    # Trimmed to the ELF proper: the section header table is the file's last bytes.
    data = out.read_bytes()
    shoff = int.from_bytes(data[0x28:0x30], "little")
    assert len(data) == shoff + int.from_bytes(data[0x3c:0x3e], "little") * int.from_bytes(data[0x3a:0x3c], "little")
    mtime = out.stat().st_mtime_ns
    assert vmlinux.extract(bz) == out and out.stat().st_mtime_ns == mtime  # cached, not redone
    assert not list(tmp_path.glob(".vmlinux.tmp-*"))


@pytest.mark.parametrize("kind,cmd", [("gzip", ["gzip", "-1c"]), ("xz", ["xz", "-0c", "--check=crc32"]),
                                      ("zstd", ["zstd", "-1cq"]), ("bzip2", ["bzip2", "-1c"])])
def test_vmlinux_other_compressions(debian_vmlinuz, tmp_path, kind, cmd):
    if not shutil.which(cmd[0]):
        pytest.skip(f"{cmd[0]} not installed")
    elf = vmlinux.extract(shutil.copy(debian_vmlinuz, tmp_path / "vmlinuz")).read_bytes()
    packed = subprocess.run(cmd, input=elf, capture_output=True, check=True).stdout
    found, out = vmlinux.find_elf(b"MZ" + os.urandom(4096) + packed + b"\x10\x20\x30\x40" + os.urandom(512))
    assert found == kind and out == elf


def test_vmlinux_without_a_kernel_is_a_clear_error():
    with pytest.raises(RuntimeError, match="no ELF kernel"):
        vmlinux.find_elf(b"\x1f\x8b\x08 not gzip at all" + bytes(1000))


# -- probe -----------------------------------------------------------------------
def test_probe_explains_what_is_missing(monkeypatch, tmp_path):
    monkeypatch.delenv("FIRECRACKER_BIN", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    ok, why = FirecrackerDriver.probe(Settings.load())
    assert not ok and "FIRECRACKER_BIN" in why
    monkeypatch.setenv("FIRECRACKER_BIN", str(tmp_path / "nope"))
    ok, why = FirecrackerDriver.probe(Settings.load())
    assert not ok and "not an executable" in why
    monkeypatch.setenv("FIRECRACKER_BIN", str(FAKE))
    ok, why = FirecrackerDriver.probe(Settings.load())
    assert ok == os.path.exists("/dev/kvm"), why
    assert ("/dev/kvm" in why) != ok
    assert DRIVERS["firecracker"] is FirecrackerDriver and FirecrackerDriver.can_checkpoint


# -- the fake itself: as strict as the swagger says ----------------------------------
def test_fake_firecracker_rejects_what_firecracker_rejects(tmp_path, fake):
    """The fake is only worth testing against if it refuses bad requests."""
    async def go():
        p = await asyncio.create_subprocess_exec(str(FAKE), "--api-sock", "api.sock", cwd=tmp_path,
                                                 stdout=subprocess.DEVNULL)
        try:
            sock = tmp_path / "api.sock"
            await asyncio.wait_for(_until(sock.exists), 10)
            (tmp_path / "k").write_bytes(b"\x7fELF fake")

            async def fault(method, path, body):
                with pytest.raises(SandboxError) as e:
                    await api_call(sock, method, path, body)
                return str(e.value)

            assert "Cannot start microvm without kernel configuration" in \
                await fault("PUT", "/actions", {"action_type": "InstanceStart"})
            assert "unknown field `kernel`" in await fault("PUT", "/boot-source", {"kernel": "k"})
            assert "missing field `kernel_image_path`" in await fault("PUT", "/boot-source", {"boot_args": "x"})
            assert "missing field `is_root_device`" in await fault("PUT", "/drives/a", {"drive_id": "a"})
            assert "does not match the id" in await fault(
                "PUT", "/drives/a", {"drive_id": "b", "is_root_device": False, "path_on_host": "k", "is_read_only": True})
            assert "expected an integer" in await fault("PUT", "/machine-config", {"vcpu_count": "2", "mem_size_mib": 1})
            assert "out of range" in await fault("PUT", "/vsock", {"guest_cid": 2, "uds_path": "v.sock"})
            assert "not supported before starting" in await fault("PATCH", "/vm", {"state": "Paused"})
            assert "unknown variant `Stopped`" in await fault("PATCH", "/vm", {"state": "Stopped"})
            assert "Invalid request method and/or path" in await fault("PUT", "/network-interfaces/eth0", {})
            assert await api_call(sock, "PUT", "/boot-source", {"kernel_image_path": "k"}) is None
            assert "not allowed after configuring" in await fault(
                "PUT", "/snapshot/load",
                {"snapshot_path": "s", "mem_backend": {"backend_type": "File", "backend_path": "m"}})
            info = await api_call(sock, "GET", "/")
            assert info["state"] == "Not started"
        finally:
            p.kill()
            await p.wait()

    run(go())
    assert [r["status"] for r in requests(fake)][-2:] == [400, 200]


async def _until(pred, interval=0.02):
    while not pred():
        await asyncio.sleep(interval)


# -- the driver against the fake ---------------------------------------------------
def test_fake_boot_sends_the_documented_sequence(tmp_path, fake):
    async def go():
        d = driver_for(tmp_path)
        spec = new_spec(tmp_path, "a", memory_mb=384, cpus=2.5)
        sb = await d.create(spec)
        try:
            ready = await read_ready(sb)
            assert "language_info" in ready.data
            assert (await ping(sb))["kernel_alive"] is True
            assert sb.running and (tmp_path / "home/runtime/firecracker" / f"{spec.id}.json").exists()
            disk = spec.workspace / "workspace.raw"
            assert disk.stat().st_size == 64 << 20 and disk.stat().st_blocks * 512 < 16 << 20  # a sparse copy
            assert (spec.state_dir / "workspace.raw").stat().st_ino == disk.stat().st_ino  # the same file
            assert (spec.state_dir / "vmlinux").read_bytes()[:4] == b"\x7fELF"
        finally:
            await sb.destroy()
        assert not spec.state_dir.exists() and not sb.running
        assert disk.exists()  # the workspace disk outlives the VM: a cold restart keeps its files

    run(go())
    got = requests(fake)
    assert [f"{r['method']} {r['path']}" for r in got] == [
        "PUT /boot-source", "PUT /drives/root", "PUT /drives/agent", "PUT /drives/workspace",
        "PUT /machine-config", "PUT /vsock", "PUT /actions"]
    assert all(r["status"] == 204 for r in got), got
    bodies = [r["body"] for r in got]
    assert bodies[0] == {"kernel_image_path": "vmlinux", "initrd_path": "initrd.gz", "boot_args": BOOT_ARGS}
    assert "console=ttyS0" in BOOT_ARGS and "sandgate.transport=vsock:1024" in BOOT_ARGS
    assert bodies[1:4] == [
        {"drive_id": "root", "path_on_host": "root.ext4", "is_root_device": True, "is_read_only": True},
        {"drive_id": "agent", "path_on_host": "agent.ext4", "is_root_device": False, "is_read_only": True},
        {"drive_id": "workspace", "path_on_host": "workspace.raw", "is_root_device": False, "is_read_only": False}]
    assert bodies[4] == {"vcpu_count": 2, "mem_size_mib": 384, "track_dirty_pages": True}  # for Diffs later
    assert bodies[5] == {"guest_cid": 3, "uds_path": "v.sock"}
    assert bodies[6] == {"action_type": "InstanceStart"}
    assert not any("network" in r["path"] for r in got)


def test_fake_cold_restart_reuses_the_workspace_disk(tmp_path, fake):
    async def go():
        d = driver_for(tmp_path)
        spec = new_spec(tmp_path, "a")
        sb = await d.create(spec)
        await read_ready(sb)
        disk = spec.workspace / "workspace.raw"
        with open(disk, "r+b") as f:  # what the guest wrote, as far as the host can tell
            f.seek(40 << 20)
            f.write(b"kept")
        await sb.destroy()
        sb = await d.create(spec.model_copy(update={"id": new_spec(tmp_path, "b").id}))
        try:
            await read_ready(sb)
            with open(disk, "rb") as f:
                f.seek(40 << 20)
                assert f.read(4) == b"kept"
        finally:
            await sb.destroy()

    run(go())


def test_fake_checkpoint_then_restore_is_refused_cleanly(tmp_path, fake):
    """Checkpoint: Pause, Full snapshot with relative paths, stop, files into
    the image. Restore: snapshot/load before anything else, at the same
    relative paths; the fake refuses it, and the driver says so and cleans up."""
    async def go():
        d = driver_for(tmp_path)
        spec = new_spec(tmp_path, "a")
        sb = await d.create(spec)
        await read_ready(sb)
        image = tmp_path / "image"
        await d.checkpoint(sb, image)
        assert not sb.running
        assert sorted(p.name for p in image.iterdir()) == ["firecracker.json", "mem", "vmstate", "workspace.raw"]
        assert (image / "mem").stat().st_size == 256 << 20
        assert (image / "mem").stat().st_mode & 0o222 == 0  # shared by every fork: read-only
        assert not list(spec.workspace.iterdir())  # no disk left for the gateway's file snapshot
        manifest = json.loads((image / "firecracker.json").read_text())
        assert set(manifest["disks"]) == {"root.ext4", "agent.ext4"} and manifest["snapshot_type"] == "Full"
        await sb.destroy()
        n_before = len(requests(fake))

        fork = new_spec(tmp_path, "fork")
        with pytest.raises(SandboxError) as e:
            await d.restore(fork, image)
        assert "Firecracker refused PUT /snapshot/load (400)" in str(e.value)
        assert "cannot restore a running process" in str(e.value)  # the fake's fault_message, verbatim
        assert "all valid" in str(e.value)  # it found the files and drives at their relative paths
        assert not fork.state_dir.exists() and not (fork.workspace / "workspace.raw").exists()
        assert sorted(p.name for p in image.iterdir()) == ["firecracker.json", "mem", "vmstate", "workspace.raw"]

        with pytest.raises(SandboxError, match="cannot restore a running process"):
            await d.restore(fork, image, consume=True)  # moved out, and put back on failure
        assert sorted(p.name for p in image.iterdir()) == ["firecracker.json", "mem", "vmstate", "workspace.raw"]
        assert not list((tmp_path / "home/runtime/firecracker").glob("*.json"))  # nothing registered is left
        return n_before

    n_before = run(go())
    got = requests(fake)
    assert [f"{r['method']} {r['path']}" for r in got[7:n_before]] == ["PATCH /vm", "PUT /snapshot/create"]
    assert got[7]["body"] == {"state": "Paused"}
    assert got[8]["body"] == {"snapshot_type": "Full", "snapshot_path": "snapshot.vmstate",
                              "mem_file_path": "snapshot.mem"}
    loads = got[n_before:]
    assert [f"{r['method']} {r['path']}" for r in loads] == ["PUT /snapshot/load"] * 2  # nothing before it
    assert loads[0]["body"] == {"snapshot_path": "vmstate", "mem_backend": {"backend_type": "File", "backend_path": "mem"},
                                "enable_diff_snapshots": True, "resume_vm": False}
    assert loads[0]["pid"] != loads[1]["pid"]  # a new Firecracker process for each restore
    # A restored VM's next snapshot must not overwrite the files it was loaded from (hard links).
    assert {loads[0]["body"]["snapshot_path"], "mem"}.isdisjoint(got[8]["body"].values())


@pytest.mark.parametrize("shared", [True, False], ids=["fork-of-a-checkpoint", "resumed-pause"])
def test_fake_restored_vm_checkpoints_as_a_diff(tmp_path, fake, shared):
    """A VM that holds the memory file it was loaded from takes a Diff snapshot
    (dirty pages only), applied onto that memory: onto a copy when a checkpoint
    shares the file, in place when it is the VM's alone. The fake cannot load a
    snapshot, so the test puts the loaded memory file in place itself."""
    async def go():
        d = driver_for(tmp_path)
        spec = new_spec(tmp_path, "a", memory_mb=64)
        sb = await d.create(spec)
        await read_ready(sb)
        base = tmp_path / "parent-mem"
        with open(base, "wb") as f:  # the parent checkpoint's memory: a page pattern to recognise
            for page in range(64 << 8):
                f.write(page.to_bytes(4, "little") * 1024)
        os.chmod(base, 0o444)
        parent = base.read_bytes()
        if shared:
            os.link(base, sb.root / "mem")  # as load() places a checkpoint's memory for a fork
        else:
            shutil.copy(base, sb.root / "mem")  # as a resumed pause moved it here
        image = tmp_path / "image"
        await d.checkpoint(sb, image)
        assert not sb.running
        manifest = json.loads((image / "firecracker.json").read_text())
        assert manifest["snapshot_type"] == "Diff" and manifest["diff_bytes"] == len(DIFF_PAGES) * 4096
        mem = (image / "mem").read_bytes()
        assert len(mem) == len(parent) and (image / "mem").stat().st_mode & 0o222 == 0
        for page in range(64 << 8):
            got = mem[page * 4096:(page + 1) * 4096]
            if page in DIFF_PAGES:
                assert got.startswith(b"dirty page %d\n" % page), page
            else:
                assert got == parent[page * 4096:(page + 1) * 4096], page
        assert base.read_bytes() == parent  # the parent checkpoint never changes
        assert (image / "mem").stat().st_ino != base.stat().st_ino
        await sb.destroy()

    run(go())
    create = [r for r in requests(fake) if r["path"] == "/snapshot/create"]
    assert [r["body"]["snapshot_type"] for r in create] == ["Diff"]


def test_apply_diff_writes_only_the_data_regions(tmp_path):
    base, diff = tmp_path / "base", tmp_path / "diff"
    base.write_bytes(b"b" * (1 << 20))
    with open(diff, "wb") as f:
        f.truncate(1 << 20)
        f.seek(8192)
        f.write(b"\0" * 4096)  # a dirty page of zeros is data, not a hole: it must be written
        f.seek(700 << 10)
        f.write(b"d" * 8192)
    assert apply_diff(diff, base) == 4096 + 8192
    got = base.read_bytes()
    assert got[8192:12288] == b"\0" * 4096 and got[700 << 10:(700 << 10) + 8192] == b"d" * 8192
    assert got[:8192] == b"b" * 8192 and got[12288:700 << 10] == b"b" * ((700 << 10) - 12288)
    diff.write_bytes(b"x")
    with pytest.raises(OSError, match="cannot apply"):
        apply_diff(diff, base)


def test_fake_pause_in_memory_is_patch_vm(tmp_path, fake):
    async def go():
        d = driver_for(tmp_path)
        sb = await d.create(new_spec(tmp_path, "a"))
        try:
            await read_ready(sb)
            n = len(requests(fake))
            link = AgentLink(sb.reader, sb.writer, lambda ch, parts: None, lambda ev: None)
            await d.freeze(sb)
            asked = asyncio.ensure_future(link.request("ping", timeout=60))
            await asyncio.sleep(2)
            assert not asked.done()  # frozen: the agent does not answer
            await d.thaw(sb)
            assert (await asked)[0]["kernel_alive"] is True  # and answers once thawed
            await link.close()
            return n
        finally:
            await sb.destroy()

    n = run(go())
    got = requests(fake)[n:]
    assert [(r["method"], r["path"], r["body"]) for r in got] == [
        ("PATCH", "/vm", {"state": "Paused"}), ("PATCH", "/vm", {"state": "Resumed"})]


def test_fake_failed_snapshot_leaves_the_vm_running_with_a_new_stream(tmp_path, fake, monkeypatch):
    monkeypatch.setenv("FAKE_FIRECRACKER_FAIL", "PUT /snapshot/create")

    async def go():
        d = driver_for(tmp_path)
        spec = new_spec(tmp_path, "a")
        sb = await d.create(spec)
        try:
            await read_ready(sb)
            old_reader = sb.reader
            with pytest.raises(SandboxError) as e:
                await d.checkpoint(sb, tmp_path / "image")
            msg = str(e.value)
            assert "runs on" in msg and "injected failure (FAKE_FIRECRACKER_FAIL) for PUT /snapshot/create" in msg
            assert sb.running
            # The snapshot reset the guest's vsock connections: the driver made a new one.
            assert sb.reader is not old_reader
            await asyncio.wait_for(old_reader.read(), 10)  # whatever was in flight, then the end
            assert old_reader.at_eof()
            await read_ready(sb, 30)
            assert (await ping(sb))["kernel_alive"] is True
            assert not (tmp_path / "image" / "mem").exists() and not (spec.state_dir / "mem").exists()
            assert (spec.workspace / "workspace.raw").exists()
        finally:
            await sb.destroy()

    run(go())
    got = requests(fake)
    assert [f"{r['method']} {r['path']}" for r in got[7:]] == ["PATCH /vm", "PUT /snapshot/create", "PATCH /vm"]
    assert got[9]["body"] == {"state": "Resumed"} and got[8]["status"] == 400


def test_fake_api_error_fails_create_with_the_fault_message(tmp_path, fake, monkeypatch):
    monkeypatch.setenv("FAKE_FIRECRACKER_FAIL", "PUT /vsock")

    async def go():
        spec = new_spec(tmp_path, "a")
        t0 = time.monotonic()
        with pytest.raises(SandboxError) as e:
            await driver_for(tmp_path).create(spec)
        assert time.monotonic() - t0 < 30
        assert str(e.value) == \
            "Firecracker refused PUT /vsock (400): injected failure (FAKE_FIRECRACKER_FAIL) for PUT /vsock"
        assert not spec.state_dir.exists()

    run(go())


def test_fake_non_elf_kernel_is_refused_at_instance_start(tmp_path, fake, fake_image, monkeypatch):
    """Not injected: the fake, like released x86_64 Firecracker, boots ELF kernels only."""
    image = tmp_path / "img"
    image.mkdir()
    for name in ("initrd.gz", "root.ext4", "workspace.ext4"):
        os.link(fake_image / name, image / name)
    (image / "vmlinux").write_bytes(b"MZ: a bzImage, say")
    monkeypatch.setenv("SANDGATE_FIRECRACKER_IMAGE", str(image))
    with pytest.raises(SandboxError) as e:
        run(driver_for(tmp_path).create(new_spec(tmp_path, "a")))
    assert str(e.value).startswith("Firecracker refused PUT /actions (400): Start microvm error: Cannot load kernel")
    assert calls(fake)[-1] == "PUT /actions"


def test_fake_long_socket_paths(tmp_path, fake):
    """Unix socket paths are limited to 107 bytes; sandbox paths can be longer."""
    deep = tmp_path / ("d" * 60) / ("e" * 60)

    async def go():
        d = driver_for(deep)
        spec = new_spec(deep, "a")
        assert len(str(spec.state_dir / "api.sock")) > 108
        sb = await d.create(spec)
        try:
            await read_ready(sb)
            r, w = await unix_connect(spec.state_dir / "api.sock")
            w.close()
        finally:
            await sb.destroy()

    run(go())


def test_fake_reap_ends_vms_a_dead_gateway_left(tmp_path, fake):
    async def go():
        d = driver_for(tmp_path)
        spec = new_spec(tmp_path, "a")
        sb = await d.create(spec)
        await read_ready(sb)
        pid = sb.proc.pid
        assert await driver_for(tmp_path).reap() == 1  # a new gateway's driver, same registry
        await asyncio.wait_for(sb.proc.wait(), 10)
        assert not spec.state_dir.exists() and not Path(f"/proc/{pid}").exists()
        assert await driver_for(tmp_path).reap() == 0

    run(go())


FAKE_JAILER = r"""#!/usr/bin/env python3
# A stand-in for Firecracker's jailer: its arguments and its chroot layout
# (<base>/<exec file name>/<id>/root, the exec file copied in, the
# environment cleared), then chdir instead of chroot (the fake firecracker is
# a Python script that needs the host's files) and exec as --uid/--gid.
import os, re, shutil, sys
args = sys.argv[1:]
fc_args = args[args.index("--") + 1:] if "--" in args else []
args = args[:args.index("--")] if "--" in args else args
if len(args) % 2 or any(not k.startswith("--") for k in args[::2]):
    sys.exit(f"Arguments parsing error: {args}")
opts = dict(zip(args[::2], args[1::2]))
for k in ("--id", "--exec-file", "--uid", "--gid"):
    if k not in opts:
        sys.exit(f"Arguments parsing error: missing {k}")
if not re.fullmatch(r"[A-Za-z0-9-]{1,64}", opts["--id"]):
    sys.exit("Invalid instance ID")
exec_file = os.path.realpath(opts["--exec-file"])
root = os.path.join(os.path.realpath(opts.get("--chroot-base-dir", "/srv/jailer")), os.path.basename(exec_file),
                    opts["--id"], "root")
os.makedirs(root, exist_ok=True)
target = os.path.join(root, os.path.basename(exec_file))
shutil.copy2(exec_file, target)
uid, gid = int(opts["--uid"]), int(opts["--gid"])
os.chown(root, uid, gid)
os.chdir(root)
env = {k: v for k, v in os.environ.items() if k.startswith(("FAKE_FIRECRACKER_", "PYENV")) or k in ("PATH", "HOME")}
os.setgid(gid)
os.setuid(uid)
os.execve(target, [target, f"--id={opts['--id']}", "--start-time-us=0", "--start-time-cpu-us=0", *fc_args], env)
"""


def test_fake_jailer_layout_checkpoint_and_restore(tmp_path, fake, monkeypatch, fake_image):
    """With SANDGATE_FIRECRACKER_JAILER: files hard-linked into the chroot,
    every path relative to it, snapshots taken from and restored into it."""
    jailer = tmp_path / "jailer"
    jailer.write_text(FAKE_JAILER)
    jailer.chmod(0o755)
    monkeypatch.setenv("SANDGATE_FIRECRACKER_JAILER", str(jailer))
    monkeypatch.setenv("SANDGATE_FIRECRACKER_UID", str(os.getuid()))  # the fake runs from this user's Python

    async def go():
        d = driver_for(tmp_path)
        spec = new_spec(tmp_path, "a")
        sb = await d.create(spec)
        chroot = spec.state_dir / "jail" / FAKE.name / spec.id / "root"
        assert sb.root == chroot and Path(os.readlink(f"/proc/{sb.proc.pid}/cwd")) == chroot
        await read_ready(sb)
        for name, src in (("vmlinux", fake_image / "vmlinux"), ("root.ext4", fake_image / "root.ext4"),
                          ("workspace.raw", spec.workspace / "workspace.raw")):
            assert (chroot / name).stat().st_ino == src.stat().st_ino and not (chroot / name).is_symlink()
        assert (chroot / "api.sock").exists() and (chroot / "v.sock").exists() and (chroot / FAKE.name).exists()
        cmdline = Path(f"/proc/{sb.proc.pid}/cmdline").read_bytes().split(b"\0")
        assert f"--id={spec.id}".encode() in cmdline and b"--api-sock" in cmdline
        image = tmp_path / "image"
        await d.checkpoint(sb, image)
        assert {"vmstate", "mem", "workspace.raw"} <= {p.name for p in image.iterdir()}
        assert json.loads((image / "firecracker.json").read_text())["jailed"] is True
        await sb.destroy()
        assert not spec.state_dir.exists()
        fork = new_spec(tmp_path, "fork")
        with pytest.raises(SandboxError, match="all valid"):  # files found at their relative paths in the new chroot
            await d.restore(fork, image)
        assert not fork.state_dir.exists()

    run(go())
    got = requests(fake)
    assert [b["body"].get("path_on_host") for b in got if b["path"].startswith("/drives/")] == \
        ["root.ext4", "agent.ext4", "workspace.raw"]
    assert got[-1]["path"] == "/snapshot/load" and got[-1]["body"]["snapshot_path"] == "vmstate"


# -- through a real gateway, with the fake binary --------------------------------------
@pytest.fixture
def fakegw(home, fake_image, tmp_path):
    log = tmp_path / "requests.jsonl"
    env = {"FIRECRACKER_BIN": str(FAKE), "SANDGATE_FIRECRACKER_IMAGE": str(fake_image),
           "FAKE_FIRECRACKER_LOG": str(log), "SANDGATE_WARM_START": "false", "SANDGATE_FIRECRACKER_JAILER": ""}
    gws = []

    def start(**extra):
        g = Gateway(home, tmp_path, env={**env, **extra})
        gws.append(g)
        return g, log

    yield start
    for g in gws:
        g.stop()


@needs_dev_kvm
def test_fake_gateway_runs_a_cell_over_vsock(fakegw):
    gw, log = fakegw()
    assert "python3-firecracker" in gw.request("GET", "/api/kernelspecs").json()["kernelspecs"]
    r = gw.request("POST", "/api/sandboxes", {"driver": "firecracker"})
    assert r.status == 201, r.body + gw.log_text().encode()[-2000:]
    sb = r.json()
    assert sb["driver"] == "firecracker" and sb["state"] == "running"
    r = gw.request("POST", f"/api/sandboxes/{sb['id']}/execute", {"code": "1+1"})
    assert r.status == 200, r.body
    assert r.json()["outputs"][0]["data"]["text/plain"] == "2"
    c = gw.connect(sb["id"])  # the Jupyter websocket reaches it too
    assert c.execute("print(6 * 7)")["stdout"] == "42\n"
    c.close()
    assert "PUT /actions" in calls(log)
    assert gw.request("DELETE", f"/api/sandboxes/{sb['id']}").status == 204
    assert not list((gw.home / "sandboxes").iterdir())


@needs_dev_kvm
def test_fake_gateway_reports_a_firecracker_error_clearly(fakegw):
    gw, log = fakegw(FAKE_FIRECRACKER_FAIL="PUT /machine-config")
    t0 = time.monotonic()
    r = gw.request("POST", "/api/sandboxes", {"driver": "firecracker"}, timeout=60)
    assert time.monotonic() - t0 < 30
    assert r.status == 503, r.body
    msg = r.json()["message"]
    assert "Firecracker refused PUT /machine-config (400): injected failure" in msg
    assert "Traceback" not in r.body.decode()
    assert gw.request("GET", "/api/sandboxes").json() == []


@needs_dev_kvm
def test_fake_gateway_killed_vmm_is_reported_dead(fakegw):
    gw, log = fakegw()
    sid = gw.request("POST", "/api/sandboxes", {"driver": "firecracker"}).json()["id"]
    assert gw.request("POST", f"/api/sandboxes/{sid}/execute", {"code": "x = 1"}).status == 200
    pid = requests(log)[-1]["pid"]
    os.kill(pid, signal.SIGKILL)
    sb = wait_for(lambda: (s := gw.request("GET", f"/api/sandboxes/{sid}").json())["state"] == "dead" and s, 30)
    assert "killed" in sb["reason"] and "SIGKILL" in sb["reason"], sb
    r = gw.request("POST", f"/api/sandboxes/{sid}/execute", {"code": "x"})
    assert r.status >= 400
    wait_for(lambda: not glob.glob(f"/tmp/fakefc-{pid}-*"), 10)  # the fake's guest left nothing behind


@needs_dev_kvm
def test_fake_gateway_checkpoint_reaches_the_fakes_refusal(fakegw):
    """The checkpoint is taken; resuming from it needs a real Firecracker, and
    the caller gets the fake's refusal, not a hang or a traceback."""
    gw, log = fakegw()
    sid = gw.request("POST", "/api/sandboxes", {"driver": "firecracker"}).json()["id"]
    r = gw.request("POST", f"/api/sandboxes/{sid}/checkpoints", {"name": "c"}, timeout=60)
    assert r.status == 503, r.body
    assert "cannot restore a running process" in r.json()["message"]
    assert calls(log)[7:] == ["PATCH /vm", "PUT /snapshot/create", "PUT /snapshot/load"]
    assert requests(log)[-1]["pid"] != requests(log)[0]["pid"]  # the restore ran in a new Firecracker



# -- the real thing -------------------------------------------------------------------
@pytest.fixture(scope="module")
def realgw(home, tmp_path_factory):
    from sandgate_images import vm

    vm.build(home)
    g = Gateway(home, tmp_path_factory.mktemp("fc"), env={"SANDGATE_WARM_START": "false"})
    yield g
    g.stop()


def ex(gw, sid, code):
    r = gw.request("POST", f"/api/sandboxes/{sid}/execute", {"code": code, "timeout": 60})
    assert r.status == 200, r.body
    return r.json()


@real
def test_real_boot_and_cell(realgw):
    ok, why = FirecrackerDriver.probe(Settings.load())
    assert ok, why
    r = realgw.request("POST", "/api/sandboxes", {"driver": "firecracker"})
    assert r.status == 201, r.body
    sid = r.json()["id"]
    out = ex(realgw, sid, "import platform, os\nprint(1 + 1, platform.release(), os.getuid())")
    two, release, uid = out["stdout"].split()
    assert two == "2" and "cloud" in release and uid == "1000"
    assert realgw.request("DELETE", f"/api/sandboxes/{sid}").status == 204


@real
def test_real_checkpoint_and_two_forks_41_42_141_41(realgw):
    sid = realgw.request("POST", "/api/sandboxes", {"driver": "firecracker"}).json()["id"]
    assert ex(realgw, sid, "x = 41\nopen('f.txt', 'w').write('before')\nprint(x)")["stdout"] == "41\n"
    r = realgw.request("POST", f"/api/sandboxes/{sid}/checkpoints", {"name": "x41"})
    assert r.status == 201, r.body
    cp = r.json()
    assert ex(realgw, sid, "x += 1; print(x)")["stdout"] == "42\n"
    fork = realgw.request("POST", f"/api/sandboxes/{sid}/fork", {"checkpoint": cp["id"]})
    assert fork.status == 201, fork.body
    fid = fork.json()["id"]
    assert ex(realgw, fid, "x += 100; print(x, open('f.txt').read())")["stdout"] == "141 before\n"
    again = realgw.request("POST", f"/api/sandboxes/{sid}/fork", {"checkpoint": cp["id"]}).json()["id"]
    assert ex(realgw, again, "print(x)")["stdout"] == "41\n"
    assert ex(realgw, sid, "print(x)")["stdout"] == "42\n"
    for s in (sid, fid, again):
        assert realgw.request("DELETE", f"/api/sandboxes/{s}").status == 204
