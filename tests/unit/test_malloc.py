"""gateway/malloc.py: with the fixed threshold, big buffers the gateway frees go
back to the host even when small objects allocated among them stay."""

import subprocess
import sys

import pytest

# Messages of 100 KiB to 3 MiB come and go (at most 30 held at once) while a few
# small objects made among them stay: the gateway's pattern when outputs pass through.
SCRIPT = """
import random, sys
import psutil
if sys.argv[1] == "tuned":
    from sandgate.malloc import return_large_blocks
    assert return_large_blocks()
rss = lambda: psutil.Process().memory_info().rss >> 20
base = rss()
first = bytearray(16 << 20)  # freed at once: untuned, glibc raises its threshold to 16 MiB here
del first
random.seed(1)
held, kept = [], []
for i in range(400):
    b = bytearray(random.randint(100 << 10, 3 << 20))
    b[::4096] = b"x" * len(b[::4096])  # touched, as a received message is
    held.append(b)
    if i % 3 == 0:
        kept.append(bytearray(2000))  # over 512 bytes: from malloc, not pymalloc's arenas
    if len(held) > 30:
        held.pop(random.randrange(len(held)))
del held, b
print(rss() - base)
"""


@pytest.mark.parametrize("mode", ["untuned", "tuned"])
def test_freed_large_buffers_return_to_the_host(mode):
    kept = int(subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True,
                              check=True).stdout)
    if mode == "tuned":
        assert kept < 16, kept  # all of it was freed: back to the host
    else:  # what the tuning is for, shown on this glibc: tens of MiB kept after everything was freed
        assert kept > 32, kept
