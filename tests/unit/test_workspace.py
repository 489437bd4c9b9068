"""Workspaces on the host (gateway/workspace.py): ext4 images on loop devices,
mounted nosuid,nodev, with a real size limit. Needs root (as CI is): loop
devices and mount are root's."""

import asyncio
import errno
import grp
import os
import pwd
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import wait_for
from sandgate import workspace as W
from sandgate.workspace import Workspace, WorkspaceError, choose_sandbox_uid, reap_mounts, sandbox_uid

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not W.quota_supported()[0],
                                reason="workspace images need root and loop devices: "
                                       f"{W.quota_supported()[1]}")

run = asyncio.run


def mount_options(path: Path) -> set:
    for line in open("/proc/self/mountinfo"):
        f = line.split()
        if f[4] == os.path.realpath(path):
            return set(f[5].split(","))
    return set()


def loops_under(root: Path) -> list:
    """Loop devices whose backing file is in ``root``."""
    out = subprocess.run(["losetup", "-a"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if str(root.resolve()) in line]


@pytest.fixture
def root(tmp_path):
    r = tmp_path / "workspaces"
    yield r
    run(reap_mounts(r))  # a failed test leaves no mount or loop device behind


def test_sandbox_uid_belongs_to_nobody_and_stays(monkeypatch):
    uid = sandbox_uid()
    for lookup in (pwd.getpwuid, grp.getgrgid):
        with pytest.raises(KeyError):
            lookup(uid)
    assert uid == sandbox_uid() and uid in W.UID_RANGE
    monkeypatch.setattr(W, "_uid", None)
    with pytest.raises(WorkspaceError, match="belongs to a user or group"):
        choose_sandbox_uid(pwd.getpwnam("nobody").pw_uid)
    with pytest.raises(WorkspaceError):
        choose_sandbox_uid(0)
    other = next(u for u in W.UID_RANGE if u != uid and W.unused_id(u))
    assert choose_sandbox_uid(other) == other and sandbox_uid() == other


def test_create_is_an_empty_sparse_image_mounted_nosuid_nodev(root):
    ws = Workspace(root, "sb1", 64, sandbox_uid())
    run(ws.create())
    run(ws.create())  # idempotent
    assert ws.quota and ws.mounted and ws.path == root / "sb1"
    assert {"nosuid", "nodev"} <= mount_options(ws.path) and "noexec" not in mount_options(ws.path)
    assert os.listdir(ws.path) == []  # no lost+found
    st = os.stat(ws.path)
    assert (st.st_uid, st.st_gid) == (sandbox_uid(), sandbox_uid())
    assert os.stat(root).st_mode & 0o777 == 0o700 and os.stat(root).st_uid == 0
    assert os.stat(ws.image).st_mode & 0o777 == 0o600
    assert os.stat(ws.image).st_blocks * 512 < 8 << 20  # sparse: the host holds what was written
    u = ws.usage()
    assert 56 << 20 <= u["size_bytes"] <= 64 << 20 and u["used_bytes"] < 4 << 20, u
    run(ws.delete())


def test_writing_past_the_size_fails_and_spares_the_host(root):
    ws = Workspace(root, "full", 64, sandbox_uid())
    run(ws.create())
    host = os.statvfs(root)
    free_before = host.f_bavail * host.f_frsize
    written = 0
    with pytest.raises(OSError) as e:
        with open(ws.path / "big", "wb") as f:
            for _ in range(1024):  # 1 GB asked, 64 MB allowed
                f.write(b"\xff" * (1 << 20))
                written += 1 << 20
            f.flush()
            os.fsync(f.fileno())
    assert e.value.errno == errno.ENOSPC
    assert written < 64 << 20
    host = os.statvfs(root)
    assert free_before - host.f_bavail * host.f_frsize < 256 << 20  # not the 1 GB asked for
    assert os.stat(ws.image).st_blocks * 512 <= 64 << 20
    assert ws.usage()["used_bytes"] > 48 << 20
    # Deleting frees the workspace again, and the host's blocks too (discard).
    (ws.path / "big").unlink()
    os.sync()
    wait_for(lambda: os.stat(ws.image).st_blocks * 512 < 16 << 20, timeout=30)
    (ws.path / "after").write_bytes(b"x" * (8 << 20))
    run(ws.delete())


def test_rename_while_mounted_keeps_files_and_flags(root):
    ws = Workspace(root, "pool-1", 32, sandbox_uid())
    run(ws.create())
    (ws.path / "f").write_text("kept")
    held = open(ws.path / "f")  # a running sandbox holds it open: it notices nothing
    run(ws.rename("user-1"))
    assert ws.id == "user-1" and ws.path == root / "user-1" and ws.mounted
    assert not (root / "pool-1").exists() and not (root / "pool-1.img").exists()
    assert (ws.path / "f").read_text() == "kept" and held.read() == "kept"
    held.close()
    assert {"nosuid", "nodev"} <= mount_options(ws.path)
    assert len(loops_under(root)) == 1 and "user-1.img" in loops_under(root)[0]
    with pytest.raises(WorkspaceError, match="exists already"):
        other = Workspace(root, "other", 32, sandbox_uid())
        run(other.create())
        run(other.rename("user-1"))
    run(other.delete())
    run(ws.detach())  # and unmounted
    run(ws.rename("user-2"))
    run(ws.attach())
    assert (ws.path / "f").read_text() == "kept"
    run(ws.delete())


def test_detach_keeps_the_data_attach_mounts_it_again(root):
    ws = Workspace(root, "sb2", 32, sandbox_uid())
    run(ws.create())
    (ws.path / "notes.txt").write_text("x = 41")
    run(ws.detach())
    run(ws.detach())
    assert not ws.mounted and ws.image.is_file() and loops_under(root) == []
    assert os.listdir(ws.path) == []  # the bare mount point
    assert ws.usage()["size_bytes"] == 32 << 20
    again = Workspace(root, "sb2", 32, sandbox_uid())  # a new gateway process
    run(again.attach())
    run(again.attach())
    assert (again.path / "notes.txt").read_text() == "x = 41"
    run(again.create())  # create on an existing image keeps it
    assert (again.path / "notes.txt").read_text() == "x = 41"
    run(again.delete())
    with pytest.raises(WorkspaceError, match="missing"):
        run(again.attach())


def test_delete_leaves_no_mount_loop_device_or_file(root):
    spaces = [Workspace(root, f"d{i}", 32, sandbox_uid()) for i in range(3)]
    for ws in spaces:
        run(ws.create())
        (ws.path / "f").write_bytes(os.urandom(1 << 20))
    assert len(loops_under(root)) == 3
    for ws in spaces:
        run(ws.delete())
        run(ws.delete())
    assert loops_under(root) == [] and os.listdir(root) == []


def test_reap_mounts_spares_the_ids_kept(root):
    a, b = Workspace(root, "a", 32, sandbox_uid()), Workspace(root, "b", 32, sandbox_uid())
    run(a.create())
    run(b.create())
    assert run(reap_mounts(root, keep={"a"})) == 1
    assert a.mounted and not b.mounted and b.image.is_file()
    assert len(loops_under(root)) == 1
    # A loop device left attached without a mount (a crash inside mount) goes too.
    dev = subprocess.run(["losetup", "-f", "--show", str(b.image)], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert run(reap_mounts(root, keep={"a"})) == 1
    assert not any(dev + ":" in line for line in loops_under(root))
    run(a.delete())
    run(b.delete())
    assert loops_under(root) == []


def test_create_refuses_to_hide_files_and_bad_sizes(root):
    (root / "legacy").mkdir(parents=True)
    (root / "legacy" / "data.csv").write_text("1,2")
    with pytest.raises(WorkspaceError, match="already holds files"):
        run(Workspace(root, "legacy", 32, sandbox_uid()).create())
    assert (root / "legacy" / "data.csv").read_text() == "1,2"
    with pytest.raises(WorkspaceError, match="at least"):
        Workspace(root, "tiny", 1, sandbox_uid())
    with pytest.raises(WorkspaceError, match="bad workspace id"):
        Workspace(root, "../etc", 32, sandbox_uid())
    shutil.rmtree(root / "legacy")


def test_without_root_a_plain_directory(root, monkeypatch):
    monkeypatch.setattr(W, "quota_supported", lambda: (False, "the gateway is not root"))
    ws = Workspace(root, "plain", 32, sandbox_uid())
    assert ws.quota is False
    run(ws.create())
    assert ws.path.is_dir() and not ws.mounted and not ws.image.exists()
    (ws.path / "f").write_bytes(b"x" * 10000)
    assert ws.usage()["used_bytes"] >= 10000 and ws.usage()["quota"] is False
    run(ws.rename("plain2"))
    assert (root / "plain2" / "f").is_file()
    run(ws.delete())
    assert not (root / "plain2").exists()
