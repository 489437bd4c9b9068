"""A VM's serial console, kept within bounds.

A guest's console is written by its kernel and, in a compromised guest, by
anyone: it must not be able to fill the host's disk or the gateway's memory.
The console arrives on a pipe (the VM process's stdout); it is copied to
``console.log`` for operators, which is rotated once to ``console.log.1`` at
``MAX_FILE`` bytes, and its last lines are kept in memory for failure reports.
"""

from __future__ import annotations

import asyncio
import collections
from pathlib import Path
from typing import BinaryIO, List, Optional

MAX_FILE = 1 << 20  # per file; with one rotation a console costs at most 2 MiB of disk
MAX_LINE = 4096  # longer lines are cut: a line without newline must not grow without end
TAIL_LINES = 200


class ConsoleLog:
    def __init__(self, path: Path, max_file: int = MAX_FILE):
        self.path, self.max_file = path, max_file
        self.tail: collections.deque = collections.deque(maxlen=TAIL_LINES)
        self.total = 0  # bytes the guest wrote, kept or not
        self._partial = b""
        self._task: Optional[asyncio.Task] = None

    def follow(self, stream: asyncio.StreamReader) -> None:
        self._task = asyncio.ensure_future(self._copy(stream))

    async def _copy(self, stream: asyncio.StreamReader) -> None:
        out = self._open()
        try:
            while True:
                chunk = await stream.read(1 << 16)
                if not chunk:
                    break
                self.total += len(chunk)
                self._lines(chunk)
                if out:
                    out = self._write(out, chunk)
        finally:
            if out:
                out.close()
            if self._partial:
                self.tail.append(self._partial.decode(errors="replace"))
                self._partial = b""

    def _open(self) -> Optional[BinaryIO]:
        try:
            return open(self.path, "ab")
        except OSError:  # the state directory went away with the sandbox: keep reading, stop copying
            return None

    def _write(self, out: BinaryIO, chunk: bytes) -> Optional[BinaryIO]:
        try:
            if out.tell() + len(chunk) > self.max_file:
                out.close()
                self.path.replace(self.path.with_name(self.path.name + ".1"))
                out = open(self.path, "ab")
            out.write(chunk)
            out.flush()
            return out
        except OSError:
            out.close()
            return None

    def _lines(self, chunk: bytes) -> None:
        *done, self._partial = (self._partial + chunk).split(b"\n")
        for line in done:
            self.tail.append(line[:MAX_LINE].decode(errors="replace").rstrip("\r"))
        self._partial = self._partial[:MAX_LINE]

    async def drained(self, timeout: float = 1.0) -> None:
        """Wait (briefly) until everything the exited VM wrote has been read."""
        if self._task:
            await asyncio.wait({self._task}, timeout=timeout)

    def lines(self) -> List[str]:
        return [ln.strip() for ln in self.tail if ln.strip()]

    def close(self) -> None:
        if self._task:
            self._task.cancel()
