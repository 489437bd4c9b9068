"""What the agent does to the guest system as an init would: the loopback
interface up, and the kernel's random generator reseeded after a restore."""

from __future__ import annotations

import fcntl
import os
import socket
import struct
import time

try:
    from .diagnostics import log
except ImportError:  # run as a script
    from diagnostics import log  # type: ignore


RNDRESEEDCRNG = 0x5207  # _IO('R', 0x07)


def reseed_kernel_random(*extra: bytes) -> None:
    """A VM restored from a snapshot resumes its kernel's random generator
    where the snapshot left it: every copy of one checkpoint draws the same
    bytes (os.urandom, uuid4, the reseed in setup) until that kernel reseeds
    on its own, up to a minute later. So mix in what differs between copies
    (the host's clock at the restore, the time here to the nanosecond) and
    have the kernel reseed now. This makes the copies differ, not secret from
    each other: entropy from the host would. RNDRESEEDCRNG needs CAP_SYS_ADMIN,
    which a VM's agent has; in gVisor randomness comes from the host kernel and
    this does nothing (or fails, harmlessly)."""
    data = b"".join(extra) + struct.pack("<3q", time.time_ns(), time.monotonic_ns(), time.perf_counter_ns())
    try:
        fd = os.open("/dev/urandom", os.O_WRONLY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.write(fd, data)
        fcntl.ioctl(fd, RNDRESEEDCRNG)
    except OSError:
        pass
    finally:
        os.close(fd)


def host_entropy(hexdigits: str) -> bytes:
    """The gateway's random bytes: with them, restored copies are not only
    different but unpredictable to each other."""
    try:
        return bytes.fromhex(hexdigits)
    except ValueError:
        return b""


SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1


def loopback_up() -> None:
    """Bring ``lo`` up if it is down: a VM's kernel leaves it down and its
    init does not touch it (gVisor's --network=none has it up already). The
    kernel gives an up loopback 127.0.0.1/8 by itself."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s.fileno(), SIOCGIFFLAGS, req))[1]
        if not flags & IFF_UP:
            fcntl.ioctl(s.fileno(), SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))
            log("brought the loopback interface up")
