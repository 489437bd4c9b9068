"""SANDGATE_GATEWAY_MEMORY_MB: the gateway process in a cgroup of its own with that memory limit, the
shims of its sandboxes outside it (a real gateway, real runsc sandboxes, this host's cgroups); and a
host where it cannot be done refuses to start with a reason."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from conftest import Gateway, host_processes
from sandgate import confine


def memory_cgroup(pid: int) -> Path:
    """The process's cgroup directory that holds its memory limit (v2's one, or v1's memory)."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return Path("/sys/fs/cgroup/memory") / path.lstrip("/")
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            return Path("/sys/fs/cgroup") / line[3:].lstrip("/")
    raise AssertionError(f"process {pid} has no memory cgroup")


def limit_of(cgroup: Path) -> int:
    f = cgroup / "memory.max" if (cgroup / "memory.max").exists() else cgroup / "memory.limit_in_bytes"
    return int(f.read_text())


def test_the_gateway_alone_is_held_to_its_memory_limit(home, tmp_path):
    g = Gateway(home, tmp_path, env={"SANDGATE_GATEWAY_MEMORY_MB": "768"})
    try:
        own = memory_cgroup(g.proc.pid)
        assert own.name.startswith("sandgate-gateway-"), own
        assert limit_of(own) == 768 << 20
        assert memory_cgroup(psutil.Process().pid) == own.parent  # under the cgroup it was started in
        sid = g.create()["id"]
        assert g.run_code(sid, "1+1").text == "2"
        shims = [p for p in host_processes(sid) if any("shim" in a for a in p.cmdline())]
        assert shims, "no shim process found for the sandbox"
        for p in shims:  # the shim outlives the gateway: never under the gateway's limit
            assert memory_cgroup(p.pid).name == "sandgate-released", memory_cgroup(p.pid)
        for p in host_processes(sid):  # and nothing of the sandbox is in the gateway's cgroup
            assert memory_cgroup(p.pid) != own, p.cmdline()
        assert g.request("DELETE", f"/api/sandboxes/{sid}").status == 204
    finally:
        g.stop()


def test_a_host_without_cgroups_gets_a_reason(tmp_path, monkeypatch):
    monkeypatch.setattr(confine, "ROOT", tmp_path / "no-cgroups")
    with pytest.raises(confine.ConfineError, match="cgroup"):
        confine.confine(512, tmp_path)
