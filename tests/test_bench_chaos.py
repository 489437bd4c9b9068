"""`sandgate bench --chaos` end to end, short and with a fixed seed: three clients doing random operations
on one real gateway (real runsc sandboxes, its home an ext4 file system on a loop file) while it is
SIGKILLed and SIGTERMed, shims and runsc sandboxes are killed and its disk fills up. The invariant
checker (bench/invariants.py) must find nothing, and every sandbox a fault touched must answer again."""

from __future__ import annotations

import json

import pytest

from sandgate import cli

pytestmark = pytest.mark.slow

SEED = 11


def test_the_chaos_soak_finds_no_violation(home, tmp_path, capsys):
    out = tmp_path / "chaos.json"
    rc = cli.main(["bench", "--chaos", "--minutes", "2", "--seed", str(SEED), "--chaos-fault-interval", "10",
                   "--chaos-disk-mb", "2048", "--home", str(home), "--output", str(out)])
    printed = capsys.readouterr()
    print(printed.out)  # shown by pytest -s or on failure
    assert rc == 0, printed.err[-3000:]
    r = json.loads(out.read_text())
    assert r["seed"] == SEED and r["faults_total"] >= 2 and r["operations"]["execute"]["run"] > 0, r
    assert not r["not_recovered"], r["not_recovered"]
    assert r["violations"] == [], "\n".join(r["violations"])
    assert "invariant violations: 0" in printed.out
