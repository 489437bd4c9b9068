"""`sandgate bench --fleet` end to end at a tiny size: a real redis-server, three real gateway nodes
(runsc sandboxes), a kill -9 of one. Checks that every figure is there and no message was lost, never
what a timing is (timings are the bench's business, not a test's)."""

from __future__ import annotations

import json

from sandgate import cli


def test_the_fleet_bench_runs_end_to_end_and_reports_every_figure(home, tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = cli.main(["bench", "--fleet", "--fleet-kernels", "3", "--fleet-seconds", "2", "--fleet-cells", "20",
                   "--fleet-lookup-seconds", "0.3", "--fleet-death", "1", "--runs", "5", "--home", str(home),
                   "--output", str(out)])
    printed = capsys.readouterr()
    print(printed.out)  # shown by pytest -s or on failure
    assert rc == 0, printed.err[-3000:]
    report = json.loads(out.read_text())

    rt = report["round_trip"]
    for path in ("ws_direct", "ws_through", "rest_direct", "rest_through"):
        assert rt[path]["n"] == 5 and rt[path]["p99_ms"] >= rt[path]["p50_ms"] > 0, path
    assert rt["ws_ratio"] > 0 and rt["rest_ratio"] > 0
    assert set(report["routing_lookups_per_s"]) == {"1", "8"}
    assert all(v > 0 for v in report["routing_lookups_per_s"].values())

    ld = report["load"]
    assert ld["kernels"] == 3 and ld["through_other_node"] == 1 and sum(ld["placement"].values()) == 3
    assert ld["cells"] > 0 and ld["p99_ms"] >= ld["p50_ms"] > 0
    assert ld["lost"] == 0, ld["errors"]
    assert isinstance(ld["split_stdout"], int)

    death = report["node_death"]
    assert death["sandboxes"] == 1 and 0 < death["first_s"] <= death["all_s"]

    for text in ("ratio through/direct", "routing lookups/s (8 concurrent)", "lost messages | 0",
                 "kill -9 to first restored sandbox answering"):
        assert text in printed.out, text
    assert "[bench" in printed.err and "kill -9 node-c" in printed.err  # progress on stderr
