"""Files read and written by their data extents (SEEK_DATA/SEEK_HOLE), so a sparse file's holes
cost nothing: hashed from zeros, never read; copied as holes, never written. Every loop checks a
``cancel`` event between steps (``Cancelled``), and a file that shrinks or grows under a read is
``Changed``. Also the sizes of a tree of files: logical (``dir_size``), allocated
(``disk_usage``)."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import stat
import threading
from pathlib import Path
from typing import Iterable, Iterator, Optional, Set, Tuple

CHUNK = 1 << 20
_ZEROS = bytes(CHUNK)  # shared: holes are hashed from it, never read from disk
_COPY_STEP = 64 << 20  # copy_file_range per call, so a cancel is seen between steps
_SEEK_DATA = getattr(os, "SEEK_DATA", None)
_SEEK_HOLE = getattr(os, "SEEK_HOLE", None)


class Cancelled(Exception):
    """The ``cancel`` event was set; the caller removes what it wrote."""


class Changed(RuntimeError):
    """A file shrank, grew or was replaced while it was being read."""


def check_cancel(cancel: Optional[threading.Event]) -> None:
    if cancel is not None and cancel.is_set():
        raise Cancelled()


def extents(fd: int, size: int, sparse: bool) -> Iterator[Tuple[int, int]]:
    """The data ranges [start, end) of an open file of ``size`` bytes; what
    lies between them is a hole. ``sparse`` False: one range, no lseek."""
    if size <= 0:
        return
    if not sparse or _SEEK_DATA is None:
        yield 0, size
        return
    off = 0
    while off < size:
        try:
            start = os.lseek(fd, off, _SEEK_DATA)
        except OSError as e:
            if e.errno == errno.ENXIO:  # only a hole is left
                return
            if e.errno in (errno.EINVAL, errno.EOPNOTSUPP) and off == 0:  # no hole support here
                yield 0, size
                return
            raise
        if start >= size:
            return
        end = min(os.lseek(fd, start, _SEEK_HOLE), size)
        yield start, end
        off = end


def is_sparse(st: os.stat_result) -> bool:
    return st.st_blocks * 512 < st.st_size


def _hash_zeros(h, n: int, cancel=None) -> None:
    while n > 0:
        if n & (64 * CHUNK - 1) == 0:  # every 64 MiB of hole
            check_cancel(cancel)
        k = min(n, CHUNK)
        h.update(_ZEROS[:k] if k < CHUNK else _ZEROS)
        n -= k


def hash_file(fd: int, st: os.stat_result, buf: bytearray, cancel) -> Tuple[str, int]:
    """sha256 of the logical content and the number of data bytes."""
    h = hashlib.sha256()
    view = memoryview(buf)
    pos = data = 0
    for start, end in extents(fd, st.st_size, is_sparse(st)):
        _hash_zeros(h, start - pos, cancel)
        off = start
        while off < end:
            check_cancel(cancel)
            n = os.preadv(fd, [view[:min(CHUNK, end - off)]], off)
            if n == 0:
                raise Changed("shrank")
            h.update(view[:n])
            off += n
        data += end - start
        pos = end
    _hash_zeros(h, st.st_size - pos, cancel)
    return h.hexdigest(), data


def _copy_range(src: int, dst: int, start: int, end: int, buf: bytearray, cancel) -> None:
    off = start
    use_cfr = hasattr(os, "copy_file_range")
    while off < end:
        check_cancel(cancel)
        n = 0
        if use_cfr:
            try:
                n = os.copy_file_range(src, dst, min(_COPY_STEP, end - off), off, off)
            except OSError as e:
                if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM):
                    raise
                use_cfr = False
                continue
        else:
            view = memoryview(buf)[:min(CHUNK, end - off)]
            n = os.preadv(src, [view], off)
            if n:
                done = 0
                while done < n:
                    done += os.pwrite(dst, view[done:n], off + done)
        if n == 0:
            raise Changed("shrank")
        off += n


def copy_sparse(src: int, dst: int, size: int, sparse: bool, buf: bytearray, cancel) -> int:
    """Copy ``size`` bytes of ``src`` into the empty ``dst``, data extents
    only; holes stay holes. Returns the data bytes copied."""
    data = 0
    for start, end in extents(src, size, sparse):
        _copy_range(src, dst, start, end, buf, cancel)
        data += end - start
    os.ftruncate(dst, size)  # the trailing hole, if any
    return data


def read_small(fd: int, size: int) -> bytes:
    parts, got = [], 0
    while True:
        b = os.pread(fd, size + 1 - got, got)  # one byte more: a file that grew is noticed
        if not b:
            break
        parts.append(b)
        got += len(b)
        if got > size:
            break
    if got != size:
        raise Changed("resized")
    return b"".join(parts)



def tree(path: Path) -> Iterator[os.stat_result]:
    """lstat of ``path`` and everything under it; links are not followed."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    yield st
    if not stat.S_ISDIR(st.st_mode):
        return
    stack = [os.fsencode(path)]
    while stack:
        try:
            with os.scandir(stack.pop()) as it:
                entries = list(it)
        except (FileNotFoundError, NotADirectoryError):
            continue
        for e in entries:
            try:
                st = e.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            yield st
            if stat.S_ISDIR(st.st_mode):
                stack.append(e.path)


def data_bytes(st: os.stat_result) -> int:
    """A stored file's data bytes: its size, less the holes of a sparse one."""
    return min(st.st_size, st.st_blocks * 512)


def stored_bytes(paths: Iterable[Path]) -> int:
    """The data bytes of those of these files that exist."""
    total = 0
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            total += data_bytes(os.stat(path))
    return total


def dir_size(path: Path) -> int:
    """Logical size of the regular files under ``path`` (holes included;
    symlinks not followed)."""
    return sum(st.st_size for st in tree(path) if stat.S_ISREG(st.st_mode))


def disk_usage(path: Path) -> int:
    """Bytes allocated on disk to ``path`` and everything under it
    (st_blocks * 512, each inode once; symlinks not followed)."""
    seen: Set[Tuple[int, int]] = set()
    total = 0
    for st in tree(path):
        if (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            total += st.st_blocks * 512
    return total
