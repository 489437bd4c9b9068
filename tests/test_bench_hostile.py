"""`sandgate bench --hostile` end to end at a small size: every hostile-load attack at once against
one real gateway (real runsc sandboxes, a real egress proxy, real sockets) while two ordinary sandboxes
run cells. The gateway must come through alive, hold its memory under the goal, and fail no ordinary
cell; timings are the bench's business, not this test's."""

from __future__ import annotations

import json

from sandgate import cli


def test_the_hostile_soak_leaves_the_gateway_standing(home, tmp_path, capsys):
    out = tmp_path / "hostile.json"
    rc = cli.main(["bench", "--hostile", "--hostile-seconds", "10", "--hostile-sandboxes", "2",
                   "--home", str(home), "--output", str(out)])
    printed = capsys.readouterr()
    print(printed.out)  # shown by pytest -s or on failure
    assert rc == 0, printed.err[-3000:]
    r = json.loads(out.read_text())
    assert r["gateway_alive"] is True
    for phase in ("quiet", "hostile"):
        assert r[phase]["cells"] > 0 and r[phase]["failures"] == 0, (phase, r[phase]["errors"])
    # every attack ran and was answered (or cut) somehow
    assert all(r["attacks"][a] for a in ("gzip", "half_open", "tokens", "downloads", "websockets", "execute", "heads")), r["attacks"]
    assert r["rss_growth_mb"] < 256, r  # the goal: one request or one sandbox must not grow the gateway by GBs
    assert r["upstream_bytes"] < 1 << 20, "an oversized head reached the allowed upstream"
    for text in ("| gateway RSS peak", "| ordinary round trip p99", "| gzip |", "| half_open |"):
        assert text in printed.out, text
