"""Running-state images stored as content-addressed, compressed chunks.

A driver's state image (gVisor's ``checkpoint.img``, qemu's ``state.mig``) is
mostly the same from one checkpoint of a sandbox to the next: the kernel's
and the interpreter's memory barely change after ``x = 41``. But it is
written as one stream whose offsets shift with every change, so fixed-size
blocks of two images share nothing (measured: 0% of 4 KiB, 64 KiB or 1 MiB
blocks). Content-defined chunking cuts the stream where its content says
(a hash of the 8 bytes before a position), so a change moves the cuts near it
only; every chunk is stored once, compressed, under the hash of its content,
and shared by every checkpoint that has it.

gVisor compresses its image itself (flate, in independent 1 MiB frames,
``pkg/compressio``): compressed bytes share nothing either, so a gVisor image
is unwrapped first: its header is kept as it is, its frames are inflated and
the inflated stream is chunked. Its chunks are stored as zstd, like any
other (codec ``zstd``, format ``gvisor``). ``assemble`` writes the stream
back uncompressed inside the framing runsc reads: frames of about 1 MiB
(consecutive chunks), each one flate stream of *stored* blocks (BTYPE 00, at
most 65535 bytes each: a chunk is one or two) ending in an empty final one,
in a new image whose header's frame size is 0xFFFFFFFF. Inflating a stored block is a copy, so runsc loads
the image without decompressing it (flate at level 1 was ~690 ms of an
~80 MB template's restore). gVisor's reader places a frame straight into the
caller's buffer only when a whole frame of the header's size fits there,
which never happens with that size, so frames of any size are read correctly
(all 20221219 reads, and later ones without ``compression: none``).

Checkpoints taken before stored their gVisor chunks as raw deflate ending in
a sync flush (codec ``deflate-sync``): those still assemble, by
concatenation (consecutive chunks and an empty final block make one frame).
Other images are chunked as they are and their chunks stored as zstd (faster
than zlib by 4-10x at a similar size).

A chunk's name is a hash of its owner, its codec and its content (one
namespace per tenant, as for workspace blobs): two owners storing the same
bytes store them twice, and ``stored_bytes`` of a checkpoint never depends on
what another tenant has stored.

The chunks an image needs are listed in ``chunks.json`` in the checkpoint's
state directory, which then no longer holds the image itself; ``assemble``
writes the image back for a restore.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import struct
import uuid
import zlib
from pathlib import Path
from typing import Dict, Iterable, Iterator, List, Optional, Set, Tuple

import numpy as np
import zstandard

MANIFEST = "chunks.json"
GVISOR_MAGIC = b"gVisorSF"
AVG_BITS = 14  # cuts every 16 KiB on average...
MIN_CHUNK = 8 << 10  # ...never closer than this (4 KiB: 15% stored instead of 18%, but 1.7x the chunks to read back)
MAX_CHUNK = 64 << 10  # ...nor further apart
_K = np.uint64(0x9E3779B97F4A7C15)
_SALT = np.uint64(0x5A17C0DE5A17C0DE)  # zeros must not hash to a cut at every offset
_BLOCK = 8 << 20
WRITERS = 4  # threads storing new chunks
_ANY_SIZE = 0xFFFFFFFF  # gVisor frame size meaning "frames of any size" (see above)
_FRAME = 1 << 20  # uncompressed bytes per frame of an assembled gVisor image, at least
_FINAL = b"\x03\x00"  # an empty final deflate block (fixed Huffman): ends a frame of sync-flushed chunks
_STORED = 0xFFFF  # bytes in a stored deflate block, at most
_STORED_FINAL = b"\x01\x00\x00\xff\xff"  # an empty final stored block: ends a frame of stored blocks
_BATCH = 128  # chunks read and decompressed at a time (about 2 MiB)


class DamagedImage(ValueError):
    """A state image or its chunks are not what the manifest says."""


# -- cutting ----------------------------------------------------------------

def cuts(buf, avg_bits: int = AVG_BITS, lo: int = MIN_CHUNK, hi: int = MAX_CHUNK) -> List[int]:
    """End offsets of the chunks of ``buf``: content-defined, between ``lo``
    and ``hi`` bytes apart (the last one may be shorter)."""
    n = len(buf)
    found: List[np.ndarray] = []
    shift = np.uint64(64 - avg_bits)
    for base in range(0, n, _BLOCK):  # bounded temporaries
        end = min(n, base + _BLOCK + 8)
        for r in range(8):
            start = base + r
            count = (end - start) // 8
            if count < 2:
                continue
            x = np.frombuffer(buf, dtype="<u8", count=count, offset=start)
            h = (x ^ _SALT) * _K
            hit = (h >> shift) == 0
            hit[1:] &= x[1:] != x[:-1]  # an 8-byte pattern repeated is one cut at most, not one per word
            # Where a run of zero words starts and ends: memory images are full of them, and
            # anchoring cuts there measured 3x fewer new bytes than the hash alone.
            zero = x == 0  # runs of 4 zero words (32 bytes) or more; single zero words are everywhere
            zero[:-3] &= zero[1:-2] & zero[2:-1] & zero[3:]
            hit[1:] |= zero[1:] != zero[:-1]
            idx = np.flatnonzero(hit)
            if len(idx):
                pos = start + idx * 8 + 8  # a cut just after the hashed window
                found.append(pos[pos < min(n, base + _BLOCK + 8)])
    cand = np.sort(np.concatenate(found)) if found else np.zeros(0, dtype=np.int64)  # repeats are harmless
    out: List[int] = []
    last = 0
    while last < n:
        i = int(np.searchsorted(cand, last + lo))
        cut = int(cand[i]) if i < len(cand) and cand[i] <= last + hi else min(last + hi, n)
        if n - cut < lo:
            cut = n
        out.append(cut)
        last = cut
    return out


# -- image formats ------------------------------------------------------------

def _read_exact(f, n: int) -> bytes:
    b = f.read(n)
    if len(b) != n:
        raise DamagedImage("truncated")
    return b


def unwrap_gvisor(path: Path) -> Optional[Tuple[bytes, bytearray]]:
    """(header, inflated stream) of a gVisor state file as runsc 20221219
    writes one (no key, so no hash between frames; every frame but the last
    inflates to the frame size); None if it is not one: it is then chunked as
    it is, which is always correct (a newer runsc's uncompressed image, too)."""
    try:
        return _unwrap_gvisor(path)
    except DamagedImage:  # truncated: not ours to judge, stored as it is
        return None


def _unwrap_gvisor(path: Path) -> Optional[Tuple[bytes, bytearray]]:
    with open(path, "rb") as f:
        if f.read(8) != GVISOR_MAGIC:
            return None
        (mlen,) = struct.unpack(">Q", _read_exact(f, 8))
        if mlen > 16 << 20:
            return None
        header = GVISOR_MAGIC + struct.pack(">Q", mlen) + _read_exact(f, mlen) + _read_exact(f, 32)  # + its HMAC
        (frame,) = struct.unpack(">I", _read_exact(f, 4))
        size = os.fstat(f.fileno()).st_size
        out = bytearray()
        short = False
        while f.tell() < size:
            (n,) = struct.unpack(">I", _read_exact(f, 4))
            data = _read_exact(f, n)
            try:
                d = zlib.decompressobj(-15)
                piece = d.decompress(data)
            except zlib.error:
                return None  # a keyed stream (a hash between frames), or not flate
            if short or len(piece) > frame or not d.eof or d.unused_data:
                return None  # not frames as runsc writes them
            short = len(piece) < frame
            out += piece
    return header, out


# -- the store ----------------------------------------------------------------

class ChunkStore:
    """Chunks under ``root``, named ``<key[:2]>/<key>``; written under a
    temporary name and renamed, so a chunk that exists is whole."""

    def __init__(self, root: Path):
        self.root = root
        self._base = str(root) + "/"
        root.mkdir(parents=True, exist_ok=True)

    def path(self, key: str) -> Path:
        return self.root / key[:2] / key

    def put_image(self, state_dir: Path, names: Iterable[str], owner: str,
                  pin) -> Tuple[int, int, Set[str]]:
        """Replace the files ``names`` of ``state_dir`` by chunks and a
        manifest. ``pin(keys)`` is called with the keys before any is looked
        up, so that a concurrent sweep keeps them. Returns (the image files'
        size, the bytes this call added to the store, the keys used); the
        image files are removed only once the manifest is written."""
        entries: Dict[str, dict] = {}
        added = 0
        keys: Set[str] = set()
        done: List[Path] = []
        for name in names:
            path = state_dir / name
            if not path.is_file():
                continue
            size = path.stat().st_size
            unwrapped = unwrap_gvisor(path)
            codec = "zstd"
            if unwrapped is not None:
                header, data = unwrapped
                entry = {"size": size, "format": "gvisor", "header": header.hex()}
            else:
                data = bytearray(path.read_bytes())
                entry = {"size": size, "format": "raw"}
            view = memoryview(data)
            prefix = hashlib.sha256(b"sandgate-chunk\0" + owner.encode() + b"\0" + codec.encode() + b"\0")
            chunks: List[Tuple[str, int, int]] = []
            start = 0
            for end in cuts(view):
                h = prefix.copy()
                h.update(view[start:end])
                chunks.append((h.hexdigest(), start, end))
                start = end
            pin({k for k, _, _ in chunks})

            def store(chunk) -> Tuple[int, int]:
                """(stored size, bytes added) of one chunk, written if it is new."""
                key, s, e = chunk
                p = self._base + key[:2] + "/" + key
                try:
                    return os.stat(p).st_size, 0
                except FileNotFoundError:
                    pass
                blob = zstandard.ZstdCompressor(level=1).compress(view[s:e])
                self._write(p, blob)
                return len(blob), len(blob)

            # Threads: compressing and creating files release the GIL, and creating thousands of
            # files is most of a first checkpoint's time (1 ms each on a loaded host).
            with concurrent.futures.ThreadPoolExecutor(WRITERS) as pool:
                results = list(pool.map(store, chunks))
            listed = []
            for (key, s, e), (stored, new) in zip(chunks, results):
                keys.add(key)
                added += new
                listed.append([key, e - s, stored])
            entry["codec"] = codec
            entry["chunks"] = listed
            entries[name] = entry
            done.append(path)
            del view, data
        if entries:
            manifest = state_dir / MANIFEST
            tmp = manifest.with_suffix(".tmp")
            tmp.write_text(json.dumps({"version": 1, "files": entries}))
            os.replace(tmp, manifest)
            added += manifest.stat().st_size
            for path in done:
                path.unlink()
        return sum(e["size"] for e in entries.values()), added, keys

    def _write(self, path: str, blob: bytes) -> None:
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        try:
            fd = os.open(tmp, flags, 0o600)
        except FileNotFoundError:
            os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
            fd = os.open(tmp, flags, 0o600)
        try:
            try:
                _write_all(fd, [blob])
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise

    def _read(self, key: str, size: int) -> bytes:
        """A chunk's stored bytes. os-level calls: a restore reads thousands of chunks, and the
        per-file cost of Path and file objects would be most of its time."""
        try:
            fd = os.open(self._base + key[:2] + "/" + key, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise DamagedImage(f"chunk {key} is missing") from None
        try:
            blob = os.read(fd, size + 1)  # one byte more: a longer file is noticed
        finally:
            os.close(fd)
        if len(blob) != size:
            raise DamagedImage(f"chunk {key} has {len(blob)} stored bytes, not {size}")
        return blob

    def assemble(self, state_dir: Path, dest: Path, level: Optional[int] = None) -> None:
        """Write the images the manifest of ``state_dir`` lists into ``dest``. ``level``: a gVisor
        image's frames deflated at that level, as runsc writes them (a quarter of the bytes, for
        a copy sent elsewhere), not stored."""
        manifest = read_manifest(state_dir)
        for name, entry in manifest["files"].items():
            if "/" in name or name in ("", ".", ".."):
                raise DamagedImage(f"unsafe name in a state manifest: {name!r}")
            fd = os.open(dest / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                parts: List[bytes] = []
                pending = 0
                gvisor = entry["format"] == "gvisor"
                if gvisor:
                    parts.append(bytes.fromhex(entry["header"]) + struct.pack(">I", _ANY_SIZE))
                if entry["codec"] == "deflate-sync":  # checkpoints from before stored frames
                    if not gvisor:
                        raise DamagedImage(f"{name}: codec deflate-sync in a {entry['format']} image")
                    self._assemble_deflate(fd, parts, entry["chunks"])
                    continue
                if entry["codec"] != "zstd":
                    raise DamagedImage(f"{name}: unknown codec {entry['codec']!r}")
                frame: List[bytes] = []
                inflated = framed = 0

                def close_frame() -> List[bytes]:
                    if level is None:
                        return [struct.pack(">I", framed + 5), *frame, _STORED_FINAL]
                    return _deflated_frame(b"".join(frame), level)

                for data in self._contents(name, entry["chunks"]):
                    length = len(data)
                    if not gvisor:
                        parts.append(data)
                    else:
                        if level is None:  # stored blocks of the chunk itself: no copy
                            for i in range(0, length, _STORED):
                                piece = data[i:i + _STORED]
                                frame += (struct.pack("<BHH", 0, len(piece), len(piece) ^ 0xFFFF), piece)
                                framed += 5 + len(piece)
                        else:
                            frame.append(data)
                        inflated += length
                        if inflated >= _FRAME:
                            parts += close_frame()
                            frame, inflated, framed = [], 0, 0
                    pending += length
                    if pending >= 4 << 20 or len(parts) >= 512:  # writev takes at most IOV_MAX (1024) buffers
                        _write_all(fd, parts)
                        parts, pending = [], 0
                if frame:
                    parts += close_frame()
                _write_all(fd, parts)
            finally:
                os.close(fd)

    def _contents(self, name: str, chunks: list) -> Iterator[bytes]:
        """The content of zstd ``chunks``, in order: read and decompressed by two threads, a batch
        or two ahead of the caller (decompressing is half of an assemble; reading a quarter)."""
        def batch(part) -> List[bytes]:
            zd = zstandard.ZstdDecompressor()  # one per batch: an instance is not for concurrent threads
            out = []
            for key, length, stored in part:
                try:
                    data = zd.decompress(self._read(key, stored), max_output_size=length)
                except zstandard.ZstdError as e:
                    raise DamagedImage(f"chunk {key} of {name} is damaged: {e}") from None
                if len(data) != length:
                    raise DamagedImage(f"chunk {key} of {name} has {len(data)} bytes, not {length}")
                out.append(data)
            return out

        batches = [chunks[i:i + _BATCH] for i in range(0, len(chunks), _BATCH)]
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            ahead = [pool.submit(batch, b) for b in batches[:2]]
            for i in range(len(batches)):
                done = ahead.pop(0).result()
                if i + 2 < len(batches):
                    ahead.append(pool.submit(batch, batches[i + 2]))
                yield from done

    def _assemble_deflate(self, fd: int, parts: List[bytes], chunks) -> None:
        """A gVisor image of sync-flushed raw deflate chunks, by concatenation: consecutive chunks
        and an empty final block make one frame of about 1 MiB."""
        frame: List[bytes] = []
        framed = inflated = 0
        for key, length, stored in chunks:
            frame.append(self._read(key, stored))
            framed += stored
            inflated += length
            if inflated >= _FRAME:
                parts += (struct.pack(">I", framed + 2), *frame, _FINAL)
                frame, framed, inflated = [], 0, 0
            if len(parts) >= 512:  # writev takes at most IOV_MAX (1024) buffers
                _write_all(fd, parts)
                parts = []
        if frame:
            parts += (struct.pack(">I", framed + 2), *frame, _FINAL)
        _write_all(fd, parts)

    def sweep(self, live: Set[str], old) -> int:
        """Remove chunks not in ``live`` (and leftover temporaries) for which
        ``old(path)`` holds; returns how many."""
        removed = 0
        for p in self.root.glob("*/*"):
            if p.name.split(".tmp-")[0] not in live and old(p):
                p.unlink(missing_ok=True)
                removed += 1
        return removed

    def size(self) -> int:
        return sum(p.stat().st_size for p in self.root.glob("*/*"))


def _deflated_frame(data: bytes, level: int) -> List[bytes]:
    """One frame of an assembled gVisor image as runsc writes one: its size, then ``data`` deflated."""
    c = zlib.compressobj(level, zlib.DEFLATED, -15)
    z = c.compress(data) + c.flush()
    return [struct.pack(">I", len(z)), z]


def _write_all(fd: int, parts: List[bytes]) -> None:
    while parts:
        n = os.writev(fd, parts)
        while parts and n >= len(parts[0]):
            n -= len(parts[0])
            parts = parts[1:]
        if parts and n:
            parts = [parts[0][n:]] + parts[1:]


def read_manifest(state_dir: Path) -> dict:
    try:
        return json.loads((state_dir / MANIFEST).read_text())
    except FileNotFoundError:
        return {"version": 1, "files": {}}
    except ValueError as e:
        raise DamagedImage(f"{state_dir / MANIFEST} is damaged: {e}") from None


def manifest_keys(state_dir: Path) -> Iterator[str]:
    for entry in read_manifest(state_dir)["files"].values():
        for chunk in entry["chunks"]:
            yield chunk[0]


def assembled_size(state_dir: Path) -> int:
    """About the bytes ``ChunkStore.assemble`` writes for ``state_dir`` (a gVisor image's frames
    stored, not deflated: several times the image runsc wrote)."""
    return sum(chunk[1] for entry in read_manifest(state_dir)["files"].values() for chunk in entry["chunks"])
