"""What the benches share: errors and progress lines, a run's end (``conclude``), free ports,
percentiles, memory read from process trees and cgroups, the preflight checks and the defaults
(home, runsc version) every bench reports."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

WARMUP = 5  # runs before a timed series
IDLE_WAIT = 3.0  # seconds an idle kernel settles before its memory is read
TIMEOUT = 180.0  # any single kernel start or execute

_t0 = time.monotonic()


class BenchError(Exception):
    """A precondition or a target failed; the message says what to do."""


def progress(msg: str) -> None:
    print(f"[bench {time.monotonic() - _t0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def conclude(failed: Optional[str], logdir: Path, output: str, report: dict, render) -> int:
    """A bench mode's end: why it failed (its logs kept), or its JSON written, its logs removed
    and ``render(report)`` printed; the exit status either way."""
    if failed:
        print(f"sandgate bench: {failed}\n  logs: {logdir}", file=sys.stderr)
        return 130 if failed == "interrupted" else 1
    Path(output).write_text(json.dumps(report, indent=1))
    shutil.rmtree(logdir, ignore_errors=True)
    print(render(report))
    print(f"\nraw numbers: {output}")
    return 0


def need_psutil():
    try:
        import psutil
    except ImportError:
        raise BenchError("psutil is not installed; it measures kernel memory: "
                         "pip install psutil (or pip install -e '.[test]')") from None
    return psutil


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(values: List[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


# -- memory ------------------------------------------------------------------

def tree_processes(procs):
    """Each of ``procs`` and all their descendants, once each (psutil.Process)."""
    psutil = need_psutil()
    seen = set()
    for p in procs:
        try:
            members = [p] + p.children(recursive=True)
        except psutil.Error:
            continue
        for q in members:
            if q.pid not in seen:
                seen.add(q.pid)
                yield q


def tree_memory(procs) -> Dict[str, Optional[int]]:
    """RSS and PSS in bytes summed over processes and all their descendants.
    RSS counts pages shared between processes once per process; PSS splits them."""
    psutil = need_psutil()
    rss, pss, count = 0, 0, 0
    for q in tree_processes(procs):
        count += 1
        try:
            rss += q.memory_info().rss
        except psutil.Error:
            continue
        if pss is not None:
            try:
                pss += q.memory_full_info().pss
            except (psutil.Error, AttributeError):
                pss = None  # not root, or no smaps: report RSS only
    return {"rss": rss, "pss": pss, "processes": count}


def own_memory(proc) -> int:
    psutil = need_psutil()
    try:
        return proc.memory_info().rss
    except psutil.Error:
        return 0


def sandbox_cgroup_memory(sandbox_id: str) -> Optional[int]:
    """What the sandbox's cgroup is charged (includes its page cache)."""
    for path in (f"/sys/fs/cgroup/memory/sandgate/{sandbox_id}/memory.usage_in_bytes",
                 f"/sys/fs/cgroup/sandgate/{sandbox_id}/memory.current"):
        try:
            return int(Path(path).read_text())
        except (OSError, ValueError):
            continue
    return None


def cell_result(ex) -> Optional[str]:
    """The text/plain of a cell's value (an SDK Execution)."""
    return ex.text


def dir_bytes(path: Path) -> Optional[int]:
    if not path.exists():
        return None
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


def runtime_memory(keys: List[str]) -> dict:
    """RSS of every process whose command line names one of keys, with descendants."""
    psutil = need_psutil()
    procs = []
    for p in psutil.process_iter(["cmdline"]):
        line = " ".join(p.info.get("cmdline") or [])
        if p.pid != os.getpid() and any(k and k in line for k in keys):
            procs.append(p)
    return tree_memory(procs)


# -- checks and defaults -------------------------------------------------------

def preflight(home: Path) -> None:
    from sandgate_images import rootfs as images

    from sandgate.drivers.gvisor import runsc_path

    need_psutil()
    missing = [m for m in ("websocket", "jupyter_client", "ipykernel", "kernel_gateway")
               if not _importable(m)]
    if missing:
        raise BenchError(f"missing Python packages: {', '.join(missing)}; pip install -e '.[test]'")
    if not runsc_path(os.environ.get("SANDGATE_RUNSC", "")):
        raise BenchError("runsc not found: install gVisor (apt-get install runsc), then `sandgate doctor`")
    if not images.is_built(home):
        flag = f" --home {home}" if home != default_home() else ""
        raise BenchError(f"the sandbox image is not built in {home}: run `sandgate image build{flag}`")


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def default_home() -> Path:
    from sandgate.config import default_home

    return default_home()


def runsc_version() -> str:
    from sandgate.drivers.gvisor import runsc_path

    try:
        out = subprocess.run([runsc_path(os.environ.get("SANDGATE_RUNSC", "")) or "runsc", "--version"], capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return "unknown"


def mib(b) -> Optional[float]:
    return None if b is None else b / 2**20
