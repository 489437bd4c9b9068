"""The gateway's own memory limit (``SANDGATE_GATEWAY_MEMORY_MB``): the gateway process moves itself
into a cgroup of its own under the one it was started in, with that memory limit, so that whatever a
client or a sandbox makes it hold ends at that bound (the kernel's OOM killer takes the gateway, whose
sandboxes outlive it and are resumed by the next start) instead of taking the node.

Only the gateway: the processes it leaves running (a gVisor sandbox's shim, a Firecracker VM) are moved
to a sibling cgroup without a limit (``release``), and sandboxes live in cgroups of their own. A systemd
unit's ``MemoryMax`` or a pod's memory limit would bound all of them together, which must grow with the
number of sandboxes; this bound does not. cgroup v2 (one hierarchy) and v1 (the memory hierarchy).
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Optional

logger = logging.getLogger("sandgate")

ROOT = Path("/sys/fs/cgroup")
GATEWAY, RELEASED = "sandgate-gateway-", "sandgate-released"
_released: Optional[Path] = None  # cgroup.procs of the sibling, once confined


class ConfineError(Exception):
    """The limit cannot be applied here; the message says why."""


def _own(hierarchy: str) -> Path:
    """This process's cgroup directory in the v2 hierarchy (``""``) or a v1 one (``"memory"``)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if (hierarchy == "" and controllers == "" and line.startswith("0::")) or hierarchy in controllers.split(","):
            base = ROOT if hierarchy == "" else ROOT / hierarchy
            own = base / path.lstrip("/")
            # Started again inside our own leaf (a re-exec): its parent is the one to use.
            return own.parent if own.name.startswith(GATEWAY) or own.name == RELEASED else own
    raise ConfineError(f"this process is in no {hierarchy or 'v2'} cgroup")


def confine(limit_mb: int, home: Path) -> Path:
    """Move this process into ``<its cgroup>/sandgate-gateway-<home's hash>`` (one gateway per home:
    two gateways on a host must not share one limit) with a memory limit of ``limit_mb``; returns that
    cgroup. Raises ConfineError when this host or user cannot."""
    global _released
    v2 = (ROOT / "cgroup.controllers").exists()
    try:
        own = _own("" if v2 else "memory")
        name = GATEWAY + hashlib.sha256(str(Path(home).resolve()).encode()).hexdigest()[:12]
        leaf, sibling = own / name, own / RELEASED
        for d in (leaf, sibling):
            d.mkdir(exist_ok=True)
        if v2:
            # No process may stay in a cgroup whose children get controllers: both leaves first.
            (leaf / "cgroup.procs").write_text(str(os.getpid()))
            for pid in (own / "cgroup.procs").read_text().split():
                (sibling / "cgroup.procs").write_text(pid)
            if "memory" not in (own / "cgroup.subtree_control").read_text().split():
                (own / "cgroup.subtree_control").write_text("+memory")
            (leaf / "memory.max").write_text(str(limit_mb << 20))
            if (leaf / "memory.swap.max").exists():
                (leaf / "memory.swap.max").write_text("0")  # a bound, not a slow gateway in swap
        else:
            (leaf / "memory.limit_in_bytes").write_text(str(limit_mb << 20))
            (leaf / "cgroup.procs").write_text(str(os.getpid()))
    except OSError as e:
        raise ConfineError(f"cannot give the gateway a cgroup of its own under {ROOT}: "
                           f"{e.strerror or e} ({getattr(e, 'filename', '') or ''})") from None
    _released = sibling / "cgroup.procs"
    logger.info("gateway memory limited to %d MiB (cgroup %s)", limit_mb, leaf)
    return leaf


def release(pid: int) -> None:
    """Move a process the gateway started, and leaves running, out of the gateway's limit."""
    if _released is None:
        return
    try:
        _released.write_text(str(pid))
    except OSError as e:  # it has exited already, or the cgroup went: nothing to bound then
        logger.debug("could not move process %d out of the gateway's cgroup: %s", pid, e)
