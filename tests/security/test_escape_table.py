"""docs/security.md's escape-suite table must say what test_escape.py collects: per category and driver,
the attempts, how many are blocked, found (open findings plus fixed ones) and fixed."""

import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

from conftest import DRIVERS
from security import escape_attempts as A

ROOT = Path(__file__).resolve().parents[2]


def collected() -> list:
    """(driver, attempt id) of every case pytest collects in test_escape.py."""
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "tests/security/test_escape.py"], cwd=ROOT, capture_output=True, text=True,
                         env=os.environ, timeout=120)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    ids = re.findall(r"^tests/security/test_escape\.py::\w+\[(\w+)-(.+)\]$", out.stdout, re.M)
    assert ids, out.stdout[-2000:]
    return ids


def doc_table() -> dict:
    text = (ROOT / "docs" / "security.md").read_text()
    section = text.split("<!-- escape-table -->")[1].split("<!-- /escape-table -->")[0]
    rows = {}
    for line in section.strip().splitlines():
        if not line.startswith("|") or line.startswith("| ---") or line.startswith("| category"):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    return rows


def test_the_docs_table_matches_the_collected_attempts():
    category = dict(A.all_attempts())
    cases = collected()
    assert sorted(cases) == sorted((d, i) for d in DRIVERS for i in category), "test ids and escape_attempts differ"
    attempts = Counter((category[i], d) for d, i in cases if (i, d) not in A.NOT_ON)  # skipped there
    open_ = Counter((category[i], d) for i, d in A.FINDINGS)
    fixed = Counter((category[i], d) for i, d in A.FIXED)
    assert all(i in category for i, _ in list(A.FINDINGS) + list(A.FIXED))
    rows = doc_table()
    want = {}
    for cat in A.CATEGORIES + ["total"]:
        cats = A.CATEGORIES if cat == "total" else [cat]
        cells = []
        for d in DRIVERS:
            n, o, f = (sum(c[(k, d)] for k in cats) for c in (attempts, open_, fixed))
            cells += [str(n), str(n - o), str(o + f), str(f)]
        want[cat] = cells + ["not run here"]
    assert rows == want
    assert sum(attempts.values()) // len(DRIVERS) >= 60
