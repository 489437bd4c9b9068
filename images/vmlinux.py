"""The uncompressed ELF kernel inside a bzImage, for VMMs that cannot boot a
bzImage: released Firecracker on x86_64 loads only an ELF ``vmlinux``.

A bzImage is real-mode setup code, a small decompressor and the compressed
kernel. Like the kernel's own scripts/extract-vmlinux, this looks for every
compression magic, decompresses from each candidate offset and keeps the
first output that is an ELF file. What follows the ELF in the payload (the
relocation table of a relocatable kernel) is trimmed off.

Decompressors: the standard library for gzip, xz, lzma and bzip2; zstd and
lz4 with the ``zstandard``/``lz4`` modules when importable, else the
``zstd``/``lz4`` programs. (The Debian 6.1 cloud kernel is lz4.)
"""

from __future__ import annotations

import bz2
import lzma
import os
import shutil
import struct
import subprocess
import threading
import zlib
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

ELF = b"\x7fELF"
MAGICS: Dict[str, bytes] = {
    "gzip": b"\x1f\x8b\x08",
    "xz": b"\xfd7zXZ\x00",
    "zstd": b"\x28\xb5\x2f\xfd",
    "lz4": b"\x02\x21\x4c\x18",  # the legacy lz4 frame the kernel uses
    "bzip2": b"BZh",
    "lzma": b"\x5d\x00\x00",
}
LZ4_LEGACY_BLOCK = 8 << 20


def _gzip(data: bytes) -> bytes:
    return zlib.decompressobj(wbits=31).decompress(data)  # stops at the end of the member


def _xz(data: bytes) -> bytes:
    return lzma.LZMADecompressor(format=lzma.FORMAT_XZ).decompress(data)


def _lzma(data: bytes) -> bytes:
    return lzma.LZMADecompressor(format=lzma.FORMAT_ALONE).decompress(data)


def _bzip2(data: bytes) -> bytes:
    return bz2.BZ2Decompressor().decompress(data)


def _program(argv: List[str], data: bytes) -> bytes:
    """Run a decompressor; what follows the stream makes it fail, so its
    status is ignored and only its output counts."""
    if not shutil.which(argv[0]):
        raise LookupError(f"{argv[0]} not found")
    return subprocess.run(argv, input=data, capture_output=True, timeout=120).stdout


def _zstd(data: bytes) -> bytes:
    try:
        import zstandard  # type: ignore
    except ImportError:
        return _program(["zstd", "-dcq"], data)
    return zstandard.ZstdDecompressor().decompressobj().decompress(data)


def _lz4(data: bytes) -> bytes:
    try:
        import lz4.block  # type: ignore
    except ImportError:
        return _program(["lz4", "-dcq"], data)
    # Legacy frame: the magic, then blocks of (u32 LE compressed size, data),
    # each at most 8 MiB decompressed, until something else follows.
    out, pos = [], 4
    while pos + 4 <= len(data):
        (size,) = struct.unpack_from("<I", data, pos)
        if size == 0 or size > LZ4_LEGACY_BLOCK + LZ4_LEGACY_BLOCK // 255 + 16 or pos + 4 + size > len(data):
            break
        try:
            out.append(lz4.block.decompress(data[pos + 4:pos + 4 + size], uncompressed_size=LZ4_LEGACY_BLOCK))
        except lz4.block.LZ4BlockError:
            break
        pos += 4 + size
    return b"".join(out)


DECOMPRESS: Dict[str, Callable[[bytes], bytes]] = {
    "gzip": _gzip, "xz": _xz, "zstd": _zstd, "lz4": _lz4, "bzip2": _bzip2, "lzma": _lzma,
}


def elf_size(elf: bytes) -> int:
    """Where a 64-bit ELF file ends: past its last segment, section and table."""
    if len(elf) < 64 or elf[4] != 2:  # not ELFCLASS64: keep everything
        return len(elf)
    end = 0
    phoff, shoff = struct.unpack_from("<QQ", elf, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", elf, 0x36)
    for i in range(phnum):
        base = phoff + i * phentsize
        (off,), (filesz,) = struct.unpack_from("<Q", elf, base + 8), struct.unpack_from("<Q", elf, base + 32)
        end = max(end, off + filesz)
    for i in range(shnum):
        base = shoff + i * shentsize
        (kind,) = struct.unpack_from("<I", elf, base + 4)
        off, size = struct.unpack_from("<QQ", elf, base + 24)
        if kind != 8:  # SHT_NOBITS takes no room in the file
            end = max(end, off + size)
    end = max(end, phoff + phnum * phentsize, shoff + shnum * shentsize)
    return min(end, len(elf)) if end > 64 else len(elf)


def find_elf(image: bytes) -> Tuple[str, bytes]:
    """(compression, ELF bytes) of the kernel inside a bzImage."""
    candidates = []
    for kind, magic in MAGICS.items():
        at = image.find(magic)
        while at >= 0:
            candidates.append((at, kind))
            at = image.find(magic, at + 1)
    missing = set()
    for at, kind in sorted(candidates):
        try:
            out = DECOMPRESS[kind](image[at:])
        except LookupError:  # no decompressor for this one here
            missing.add(kind)
            continue
        except (OSError, EOFError, ValueError, zlib.error, lzma.LZMAError, subprocess.SubprocessError):
            continue
        except Exception:  # the optional modules raise their own error types
            continue
        if out.startswith(ELF):
            return kind, out[:elf_size(out)]
    hint = f" (no decompressor for {', '.join(sorted(missing))}: install it)" if missing else ""
    raise RuntimeError(f"no ELF kernel found inside the bzImage{hint}")


def compression(vmlinuz: Path) -> str:
    return find_elf(Path(vmlinuz).read_bytes())[0]


def extract(vmlinuz: Path, dest: Optional[Path] = None) -> Path:
    """The ELF kernel of ``vmlinuz``, cached as ``vmlinux`` beside it; written
    to a temporary name and renamed, so a half-written file is never used."""
    vmlinuz = Path(vmlinuz)
    dest = Path(dest) if dest else vmlinuz.with_name("vmlinux")
    try:
        if dest.stat().st_mtime >= vmlinuz.stat().st_mtime and dest.open("rb").read(4) == ELF:
            return dest
    except OSError:
        pass
    _, elf = find_elf(vmlinuz.read_bytes())
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}-{threading.get_ident()}")  # unique per thread
    try:
        tmp.write_bytes(elf)
        os.chmod(tmp, 0o644)
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest
