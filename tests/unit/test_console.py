"""A VM's serial console is bounded on disk and in memory, whatever the guest
writes (the flood from a real guest is in test_qemu.py)."""

import asyncio

from sandgate.drivers.console import MAX_LINE, ConsoleLog


def follow(tmp_path, chunks, max_file):
    async def go():
        stream = asyncio.StreamReader()
        log = ConsoleLog(tmp_path / "console.log", max_file=max_file)
        log.follow(stream)
        for c in chunks:
            stream.feed_data(c)
            await asyncio.sleep(0)
        stream.feed_eof()
        await log.drained(10)
        return log

    return asyncio.run(go())


def test_a_flood_is_rotated_and_only_its_tail_kept(tmp_path):
    chunks = [b"".join(b"line %07d\n" % (i * 1000 + j) for j in range(1000)) for i in range(100)]  # 13 MB
    log = follow(tmp_path, chunks, max_file=1 << 20)
    assert log.total == sum(map(len, chunks))
    sizes = [(tmp_path / n).stat().st_size for n in ("console.log", "console.log.1")]
    assert all(0 < s <= 1 << 20 for s in sizes), sizes
    assert log.lines()[-1] == "line 0099999" and len(log.lines()) == 200
    assert (tmp_path / "console.log").read_bytes().endswith(b"line 0099999\n")


def test_a_line_without_end_is_cut(tmp_path):
    log = follow(tmp_path, [b"Kernel panic - not syncing\n"] + [b"x" * 65536] * 40, max_file=1 << 20)
    assert log.lines()[0] == "Kernel panic - not syncing"
    assert len(log.lines()[-1]) == MAX_LINE
    assert log.total == 27 + 40 * 65536


def test_a_vanished_directory_stops_only_the_copy(tmp_path):
    log = follow(tmp_path / "gone", [b"boot\n", b"more\n"], max_file=1 << 20)
    assert log.lines() == ["boot", "more"] and log.total == 10  # still read: a guest must never block on it
