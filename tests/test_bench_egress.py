"""`sandgate bench --egress` end to end at a tiny size: a real gateway and gVisor sandboxes, the bench's
own servers on 127.0.0.3/.4. Checks that every figure is there, never what it is (timings are the
bench's business, not a test's)."""

from __future__ import annotations

import json

from sandgate import cli
from sandgate_bench import egress

CPU = {  # where each location's CPU time is read, per request
    "host-direct": ("client_cpu_ms_per_req",),
    "host-proxy": ("client_cpu_ms_per_req", "proxy_cpu_ms_per_req"),
    "sandbox-proxy": ("runsc_cpu_ms_per_req", "shim_cpu_ms_per_req", "proxy_cpu_ms_per_req",
                      "kernel_inside_cpu_ms_per_req", "agent_inside_cpu_ms_per_req"),
}


def test_the_egress_bench_runs_end_to_end_and_reports_every_figure(home, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(egress, "ROUNDS", 1)
    out = tmp_path / "bench.json"
    rc = cli.main(["bench", "--egress", "--egress-seconds", "0.2", "--runs", "3", "--home", str(home),
                   "--output", str(out)])
    printed = capsys.readouterr()
    print(printed.out)  # shown by pytest -s or on failure
    assert rc == 0, printed.err[-3000:]
    report = json.loads(out.read_text())

    summary = report["egress"]
    assert set(summary) == {"http", "https"}
    for scheme, cells in summary.items():
        assert set(cells) == {"small_c1", "small_c16", "large_c1", "large_c16", "new_c1"}
        for cell, locations in cells.items():
            assert set(locations) == {"host-direct", "host-proxy", "sandbox-proxy"}
            for loc, figures in locations.items():
                assert figures["n"] > 0, (scheme, cell, loc)
                for key in ("p50_ms", "p99_ms", "req_s", "mb_s", "upstream_cpu_ms_per_req") + CPU[loc]:
                    assert isinstance(figures[key], float), (scheme, cell, loc, key)
            for pair in ("host-proxy/host-direct", "sandbox-proxy/host-direct", "sandbox-proxy/host-proxy"):
                ratios = report["egress_ratios"][scheme][cell][pair]
                assert set(ratios) == {"p50_ms", "p99_ms", "req_s", "mb_s"} and ratios["req_s"] > 0, (cell, pair)
    # 16 connections really ran 16 at once: each did its requests.
    assert all(r["n"] >= 16 for r in report["raw"]["egress"]["https"]["small_c16"]["sandbox-proxy"])

    rt = report["roundtrip"]
    for which in ("egress_off", "egress_on"):  # two sandboxes each, 3 round trips each
        assert rt[which]["n"] == 6 and rt[which]["p50_ms"] > 0 and rt[which]["p99_ms"] >= rt[which]["p50_ms"]
    for name in ("egress_off-1", "egress_on-1", "egress_on-2", "egress_off-2"):
        assert rt[name]["n"] == 3, name
    assert rt["ratio_p50"] > 0 and rt["ratio_p99"] > 0
    assert {k: len(v) for k, v in report["boot_s"].items()} == {"egress_off": 2, "egress_on": 2}
    assert report["config"]["upstream"]["http"].startswith("127.0.0.3:")
    assert report["config"]["upstream"]["https"].startswith("127.0.0.4:")

    # The tables: both schemes, the three locations and their ratios, the round trip.
    for text in ("| HTTP ", "| HTTPS ", "host-direct", "sandbox/direct", "1 KiB, 16 connections: requests/s",
                 "1 MiB, 1 connection: MB/s", "| 1+1 round trip (ms)", "on/off"):
        assert text in printed.out, text
    assert "[bench" in printed.err and "round 1/1" in printed.err  # progress on stderr
