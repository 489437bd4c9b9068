"""glibc's allocator, tuned for a process that passes large messages through.

glibc serves a large block from its own mapping (handed back to the kernel on
free) only above a threshold, and it raises that threshold to the size of each
such block freed, up to 32 MiB. After the first big kernel output, blocks of a
few MiB then come from the heap, and freeing them leaves holes the process keeps:
a client that buffered 46 MiB before it was dropped left the gateway ~150 MiB
larger for good (tests/security/test_gateway_bounds.py). A fixed threshold
keeps every block over 128 KiB in its own mapping, so memory a dropped client
or a finished checkpoint held goes back to the host."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("sandgate")

M_MMAP_THRESHOLD = -3  # <malloc.h>; setting it also turns the dynamic raise off
THRESHOLD = 128 << 10


def return_large_blocks() -> bool:
    """Fix glibc's mmap threshold for this process; False where there is no glibc."""
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):  # musl and others: no mallopt, nothing to tune
        return False
    if not mallopt(M_MMAP_THRESHOLD, THRESHOLD):
        log.warning("mallopt(M_MMAP_THRESHOLD) refused; large freed buffers may stay in the gateway's memory")
        return False
    return True
