"""`sandgate bench --density N` end to end with one sandbox: it reports the
sandbox's memory beside a local ipykernel's, broken down by host process, and
a sandbox paused to disk leaves no host process behind."""

from __future__ import annotations

import json
import subprocess
import sys


def test_density_bench_with_one_sandbox(home, tmp_path):
    out = tmp_path / "density.json"
    p = subprocess.run([sys.executable, "-m", "sandgate.cli", "bench", "--density", "1", "--home", str(home),
                        "--output", str(out)], capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, p.stderr[-2000:]
    r = json.loads(out.read_text())
    assert r["n"] == 1 and r["local"]["pss"] > 0 and r["sandgate"]["pss"] > r["local"]["pss"] / 2
    kinds = r["sandgate"]["by_kind"]
    assert "runsc boot (sentry)" in kinds and "shim (python)" in kinds
    assert sum(k["pss"] for k in kinds.values()) <= r["sandgate"]["pss"] * 1.1
    assert r["paused"]["processes"] == 0 and r["paused"]["disk_bytes"] > 1 << 20
    assert "PSS per idle kernel, 1 together" in p.stdout and "paused to disk: 0 host processes left" in p.stdout
