"""`sandgate bench --load N` end to end at a tiny size: 3 real runsc sandboxes behind a real gateway
beside 3 local ipykernels behind a real Kernel Gateway, each driven for a few seconds. Checks that every
figure is in the JSON and the table and that no message was lost, duplicated or out of order, never
what a timing is (timings are the bench's business)."""

from __future__ import annotations

import json

from sandgate import cli


def test_the_load_bench_runs_end_to_end_and_loses_nothing(home, tmp_path, capsys):
    out = tmp_path / "load.json"
    rc = cli.main(["bench", "--load", "3", "--load-seconds", "3", "--home", str(home), "--output", str(out)])
    printed = capsys.readouterr()
    print(printed.out)  # shown by pytest -s or on failure
    assert rc == 0, printed.err[-3000:]
    r = json.loads(out.read_text())
    assert r["n"] == 3 and r["seconds"] == 3
    for side in ("sandgate", "kernel-gateway"):
        s = r[side]
        assert s["kernels"] == 3 and s["cells"] >= 3 and s["p99_ms"] >= s["p50_ms"] > 0, side
        assert (s["lost"], s["duplicated"], s["out_of_order"], s["failures"]) == (0, 0, 0, 0), s["errors"]
        # each cell: the request out; busy, execute_input, stdout (sometimes split), reply, idle back
        assert s["messages"] >= 6 * s["cells"], side
        assert s["gateway_cpu_s"] > 0 and s["gateway_cpu_us_per_message"] > 0, side
        assert s["start_all_s"] > 0 and len(s["loadavg"]) == 3
    assert all(r["ratios"][k] > 0 for k in ("p50_ms", "p99_ms", "cells_per_s", "gateway_cpu_us_per_message"))
    for text in ("| 3 kernels x 3 s", "gateway CPU per message (us)", "| lost | 0 | 0 |", "| duplicated | 0 | 0 |"):
        assert text in printed.out, text
    assert "sandgate-gvisor: 3/3 kernels up" in printed.err  # progress while starting, on stderr


def test_the_load_bench_refuses_a_bad_size(capsys):
    assert cli.main(["bench", "--load", "0"]) == 2
    assert "--load needs at least 1 kernel" in capsys.readouterr().err
