"""`sandgate ls`, `tree` and `exec` against a real gateway, as a person runs them."""

from __future__ import annotations

import subprocess
import sys

from conftest import Gateway


def sandgate(g: Gateway, *args, stdin=None):
    return subprocess.run([sys.executable, "-m", "sandgate.cli", *args, "--url", g.url, "--token", g.token],
                          capture_output=True, text=True, input=stdin, timeout=300)


def test_ls_tree_and_exec(home, tmp_path):
    g = Gateway(home, tmp_path, env={"SANDGATE_WARM_START": "false"})
    try:
        assert sandgate(g, "ls").stdout.strip() == "no sandboxes"
        sid = g.request("POST", "/api/sandboxes", {"labels": {"task": "demo"}}).json()["id"]
        out = sandgate(g, "exec", sid, "import sys\nprint('to stdout')\nprint('to stderr', file=sys.stderr)\n6 * 7")
        assert out.returncode == 0 and out.stdout == "to stdout\n42\n" and out.stderr == "to stderr\n", out
        piped = sandgate(g, "exec", sid, "-", stdin="print(sum(range(4)))")
        assert piped.stdout == "6\n", piped
        failed = sandgate(g, "exec", sid, "1 / 0")
        assert failed.returncode == 1 and "ZeroDivisionError" in failed.stderr, failed  # the cell's traceback
        cp = g.request("POST", f"/api/sandboxes/{sid}/checkpoints", {"name": "first"}).json()["id"]
        fork = g.request("POST", f"/api/sandboxes/{sid}/fork", {"checkpoint": cp}).json()["id"]
        table = sandgate(g, "ls").stdout.splitlines()
        assert table[0].split() == ["ID", "STATE", "AGE", "MEMORY", "CHECKPOINTS", "DRIVER", "LABELS"]
        mine = next(line for line in table if line.startswith(sid))
        assert "running" in mine and "1024 MB" in mine and "gvisor" in mine and "task=demo" in mine
        assert mine.split("MB")[1].split()[0] == "1"  # its one checkpoint
        tree = sandgate(g, "tree", sid).stdout.splitlines()
        assert tree[0] == f"sandbox {sid} (running)"
        assert tree[1].startswith(f"└─ checkpoint {cp} \"first\"")
        assert tree[2] == f"   └─ sandbox {fork} (running)"
        gone = sandgate(g, "exec", "00000000-0000-4000-8000-000000000000", "1")
        assert gone.returncode == 1 and "does not exist" in gone.stderr and "Traceback" not in gone.stderr, gone
        bad = sandgate(g, "tree", "nope")
        assert bad.returncode == 1 and "no sandbox nope" in bad.stderr
    finally:
        g.stop()
