"""Running-state images as shared chunks (gateway/checkpoints/state_chunks.py, through
CheckpointStore), in-process on files made here: content-defined cuts, gVisor's
framed image and a plain one round-tripping byte for byte, what a second
image after a small change adds, sweep, pins, tenants, old whole images and
damage. The same on real runsc sandboxes: tests/test_checkpoints.py."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import random
import struct
import threading
import zlib
from pathlib import Path

import pytest

from sandgate.checkpoints import Checkpoint, CheckpointStore
from sandgate.checkpoints.state_chunks import (MANIFEST, MAX_CHUNK, MIN_CHUNK, DamagedImage, cuts, manifest_keys,
                                   unwrap_gvisor)

MiB = 1 << 20


def memory_like(seed: int, size: int = 8 * MiB) -> bytearray:
    """Something like a memory image: random pages, zero pages, and pages of small integers."""
    rnd = random.Random(seed)
    out = bytearray()
    while len(out) < size:
        kind = rnd.random()
        if kind < 0.3:
            out += bytes(4096)
        elif kind < 0.6:
            out += rnd.randbytes(4096)
        else:
            out += struct.pack("<512Q", *(rnd.randrange(1 << 16) for _ in range(512)))
    return out[:size]


def small_change(data: bytearray, seed: int) -> bytearray:
    """A few bytes changed and an insertion near the start: every later offset shifts."""
    rnd = random.Random(seed)
    out = bytearray(data)
    for _ in range(5):
        i = rnd.randrange(len(out))
        out[i] ^= 0xFF
    out[1000:1000] = rnd.randbytes(300)
    return out


def gvisor_image(stream: bytes, meta: dict) -> bytes:
    """A state file framed the way runsc 20221219 writes one: magic, metadata,
    its HMAC (empty key), frame size, then 1 MiB frames of raw deflate."""
    m = json.dumps(meta).encode()
    head = b"gVisorSF" + struct.pack(">Q", len(m)) + m
    import hmac
    head += hmac.new(b"", head, hashlib.sha256).digest()
    out = [head, struct.pack(">I", MiB)]
    for i in range(0, len(stream), MiB):
        c = zlib.compressobj(1, zlib.DEFLATED, -15)
        z = c.compress(stream[i:i + MiB]) + c.flush()
        out += [struct.pack(">I", len(z)), z]
    return b"".join(out)


def take(store: CheckpointStore, name: str, image: bytes, owner: str = "", extra: dict = None) -> Checkpoint:
    """A checkpoint whose driver wrote ``image`` as ``name`` (and ``extra`` files kept whole)."""
    cid, _ = store.new_dir()
    state = store.state_dir(cid)
    state.mkdir()
    (state / name).write_bytes(image)
    for n, b in (extra or {}).items():
        (state / n).write_bytes(b)
    state_bytes, stored = store.store_state(cid, owner, (name,))
    cp = Checkpoint(id=cid, sandbox="sb", owner=owner, created=0, state_bytes=state_bytes, files_bytes=0,
                    new_bytes=0, stored_bytes=stored)
    store.commit(cp)
    return cp


def restored(store: CheckpointStore, cid: str, name: str) -> bytes:
    async def go():
        async with store.restorable(cid) as d:
            return (d / name).read_bytes(), d
    data, d = asyncio.run(go())
    # An image assembled for this restore is gone after it; a kept one (assembled/) stays.
    assert not d.exists() or d in (store.state_dir(cid), store.items / cid / "assembled")
    return data


def test_cuts_are_content_defined_and_bounded():
    data = memory_like(1)
    ends = cuts(data)
    assert ends[-1] == len(data)
    sizes = [b - a for a, b in zip([0] + ends, ends)]
    assert all(MIN_CHUNK <= s <= MAX_CHUNK for s in sizes[:-1]) and sizes[-1] <= MAX_CHUNK
    assert cuts(data) == ends  # deterministic
    shifted = b"x" * 777 + data
    later = {e for e in cuts(shifted)}
    # After the insertion the cuts fall at the same content: most ends, moved by 777, are cuts again.
    assert len([e for e in ends if e + 777 in later]) > 0.9 * len(ends)


def test_plain_image_round_trips_and_a_second_one_adds_little(tmp_path):
    store = CheckpointStore(tmp_path / "ck")
    first = memory_like(2)
    cp1 = take(store, "state.mig", bytes(first), extra={"vm.json": b"{}"})
    state = store.state_dir(cp1.id)
    assert sorted(p.name for p in state.iterdir()) == [MANIFEST, "vm.json"]  # the image itself is gone
    assert cp1.state_bytes == len(first) + 2
    assert 0 < cp1.stored_bytes < len(first)  # compressed: the zero pages cost nothing
    second = small_change(first, 3)
    cp2 = take(store, "state.mig", bytes(second))
    assert cp2.stored_bytes < 0.25 * cp2.state_bytes, (cp2.stored_bytes, cp2.state_bytes)
    assert restored(store, cp1.id, "state.mig") == first
    assert restored(store, cp2.id, "state.mig") == second

    async def others():
        async with store.restorable(cp1.id) as d:  # files kept whole are there too, as links to the real ones
            return (d / "vm.json").read_bytes(), (d / "vm.json").resolve()
    body, real = asyncio.run(others())
    assert body == b"{}" and real == (state / "vm.json").resolve()


def test_gvisor_image_is_unwrapped_and_reassembled_as_frames_of_any_size(tmp_path):
    store = CheckpointStore(tmp_path / "ck")
    stream = bytes(memory_like(4, 5 * MiB + 12345))
    image = gvisor_image(stream, {"_timestamp": "now", "cpu_usage": "1s"})
    header_len = 16 + len(json.dumps({"_timestamp": "now", "cpu_usage": "1s"})) + 32
    cp = take(store, "checkpoint.img", image)
    manifest = json.loads((store.state_dir(cp.id) / MANIFEST).read_text())["files"]["checkpoint.img"]
    assert manifest["format"] == "gvisor" and manifest["codec"] == "zstd" and manifest["size"] == len(image)
    back = restored(store, cp.id, "checkpoint.img")
    assert back[:header_len] == image[:header_len]  # header and its HMAC as runsc wrote them
    assert struct.unpack(">I", back[header_len:header_len + 4])[0] == 0xFFFFFFFF
    header, inflated = unwrap_gvisor_bytes(tmp_path, back)
    assert inflated == stream
    frames, off = 0, header_len + 4
    while off < len(back):  # chunks joined into frames of about 1 MiB, as many as runsc writes
        n = struct.unpack(">I", back[off:off + 4])[0]
        assert stored_blocks(back[off + 4:off + 4 + n]) == back[off + 4:off + 4 + n]  # nothing left to inflate
        off += 4 + n
        frames += 1
    assert off == len(back) and frames <= len(stream) // MiB + 1, frames
    assert len(back) < header_len + 4 + len(stream) * 1.001  # stored: 5 bytes a 64 KiB block, 4 a frame
    # A second image a small change apart adds little, in compressed bytes against the compressed image.
    cp2 = take(store, "checkpoint.img", gvisor_image(bytes(small_change(bytearray(stream), 5)), {"_timestamp": "t2"}))
    assert cp2.stored_bytes < 0.25 * cp2.state_bytes, (cp2.stored_bytes, cp2.state_bytes)


def unwrap_gvisor_bytes(tmp_path: Path, data: bytes):
    """Header and inflated stream of an assembled image, read as gVisor's reader does: frames of any
    size (unwrap_gvisor takes only what runsc writes, frames of the header's size)."""
    (mlen,) = struct.unpack(">Q", data[8:16])
    off = 16 + mlen + 32 + 4
    out = bytearray()
    while off < len(data):
        (n,) = struct.unpack(">I", data[off:off + 4])
        out += zlib.decompress(data[off + 4:off + 4 + n], -15)
        off += 4 + n
    return data[:16 + mlen + 32], bytes(out)


def test_an_image_assembled_to_be_sent_elsewhere_is_deflated(tmp_path):
    """The S3 replica uploads the whole image (checkpoints/replica.py): its frames deflated as runsc
    writes them, not stored."""
    store = CheckpointStore(tmp_path / "ck")
    stream = bytes(memory_like(16, 3 * MiB))
    cp = take(store, "checkpoint.img", gvisor_image(stream, {}))
    for level, d in ((None, tmp_path / "stored"), (1, tmp_path / "deflated")):
        d.mkdir()
        store.chunks.assemble(store.state_dir(cp.id), d, level=level)
    stored, deflated = ((tmp_path / d / "checkpoint.img").read_bytes() for d in ("stored", "deflated"))
    assert unwrap_gvisor_bytes(tmp_path, deflated)[1] == stream
    assert len(deflated) < 0.8 * len(stored), (len(deflated), len(stored))


def stored_blocks(frame: bytes) -> bytes:
    """``frame`` walked as deflate stored blocks (BTYPE 00), the last one final and ending it."""
    off = 0
    while True:
        head = frame[off]
        assert head & 0b110 == 0, f"block at {off} is not stored: {head:#x}"
        length, nlen = struct.unpack("<HH", frame[off + 1:off + 5])
        assert nlen == length ^ 0xFFFF
        off += 5 + length
        if head & 1:
            assert off == len(frame)
            return frame


def to_deflate_sync(store: CheckpointStore, cid: str) -> None:
    """Rewrite checkpoint ``cid``'s gVisor image as checkpoints before stored frames kept theirs:
    each chunk raw deflate (level 1) ending in a sync flush, codec "deflate-sync"; the old chunks
    are left to sweep. Written here, not by the store, which writes that format no more."""
    import zstandard

    state = store.state_dir(cid)
    manifest = json.loads((state / MANIFEST).read_text())
    entry = manifest["files"]["checkpoint.img"]
    assert entry["format"] == "gvisor" and entry["codec"] == "zstd"
    listed = []
    for key, length, stored in entry["chunks"]:
        data = zstandard.ZstdDecompressor().decompress(store.chunks.path(key).read_bytes(), max_output_size=length)
        c = zlib.compressobj(1, zlib.DEFLATED, -15)
        blob = c.compress(data) + c.flush(zlib.Z_SYNC_FLUSH)
        old = hashlib.sha256(b"old-format\0" + data).hexdigest()
        store.chunks.path(old).parent.mkdir(exist_ok=True)
        store.chunks.path(old).write_bytes(blob)
        listed.append([old, length, len(blob)])
    entry.update(codec="deflate-sync", chunks=listed)
    (state / "chunks.tmp").write_text(json.dumps(manifest))
    os.replace(state / "chunks.tmp", state / MANIFEST)


def test_gvisor_images_stored_before_as_deflate_sync_still_restore(tmp_path):
    store = CheckpointStore(tmp_path / "ck")
    stream = bytes(memory_like(12, 3 * MiB + 999))
    cp = take(store, "checkpoint.img", gvisor_image(stream, {"_timestamp": "old"}))
    to_deflate_sync(store, cp.id)
    back = restored(store, cp.id, "checkpoint.img")
    assert struct.unpack(">I", back[16 + len(b'{"_timestamp": "old"}') + 32:][:4])[0] == 0xFFFFFFFF
    assert unwrap_gvisor_bytes(tmp_path, back)[1] == stream


def test_a_kept_image_is_assembled_once_and_goes_with_its_checkpoint(tmp_path):
    store = CheckpointStore(tmp_path / "ck")
    stream = bytes(memory_like(13, 2 * MiB))
    cp = take(store, "checkpoint.img", gvisor_image(stream, {}), extra={"meta.json": b"{}"})
    once = restored(store, cp.id, "checkpoint.img")

    async def kept():
        async with store.restorable(cp.id, keep=True) as d:
            return d, (d / "checkpoint.img").read_bytes(), (d / "meta.json").read_bytes()
    d, image, meta = asyncio.run(kept())
    assert d == store.items / cp.id / "assembled" and d.is_dir()  # still there after the restore
    assert image == once and meta == b"{}"
    # Assembled once: later restores read the kept image, not the chunks (here gone).
    key = next(manifest_keys(store.state_dir(cp.id)))
    store.chunks.path(key).rename(tmp_path / "aside")
    assert asyncio.run(kept())[1] == once
    assert restored(store, cp.id, "checkpoint.img") == once  # any restore reads a kept image
    store.chunks.path(key).parent.joinpath(key).write_bytes((tmp_path / "aside").read_bytes())
    # Not in the record's accounting (a copy of the chunks); kept by a sweep while committed.
    assert store.get(cp.id).stored_bytes == cp.stored_bytes < len(once)
    store.sweep()
    assert d.is_dir()
    store.discard(cp.id)
    assert not d.exists()


def test_an_image_assembled_ahead_is_what_the_next_restore_reads(tmp_path):
    store = CheckpointStore(tmp_path / "ck", kept_bytes=64 * MiB)
    image = bytes(memory_like(15, 2 * MiB))
    cp = take(store, "state.mig", image, extra={"vm.json": b"{}"})

    assembled = []
    real_assemble = store.chunks.assemble
    store.chunks.assemble = lambda *a, **kw: (assembled.append(a), real_assemble(*a, **kw))[1]

    async def ahead_then_restore():
        ahead = store.assemble_ahead(cp.id)
        async with store.restorable(cp.id) as d:  # started at once: it waits for the assembly, not a second one
            return await ahead, d, (d / "state.mig").read_bytes(), (d / "vm.json").read_bytes()
    _, d, body, meta = asyncio.run(ahead_then_restore())
    assert d == store.items / cp.id / "assembled" and d.is_dir()  # kept after the restore
    assert body == image and meta == b"{}"
    assert len(assembled) == 1  # by whichever came first; the other used it
    assert not (store.root / "restoring").exists() or not any((store.root / "restoring").iterdir())
    # Nothing to assemble ahead for a whole image, or for a store other nodes share.
    whole, _ = store.new_dir()
    store.state_dir(whole).mkdir()
    assert store.assemble_ahead(whole) is None
    shared = CheckpointStore(tmp_path / "shared", shared=True, kept_bytes=64 * MiB)
    cp2 = take(shared, "state.mig", image)
    assert shared.assemble_ahead(cp2.id) is None
    assert restored(shared, cp2.id, "state.mig") == image and not (shared.items / cp2.id / "assembled").exists()


def test_kept_images_beyond_their_budget_go_least_recently_used_first_but_never_one_in_use(tmp_path):
    store = CheckpointStore(tmp_path / "ck", kept_bytes=5 * MiB)  # two of the 2 MiB images below
    images = [bytes(memory_like(20 + i, 2 * MiB)) for i in range(4)]
    cps = [take(store, "state.mig", im) for im in images]
    kept = [store.items / cp.id / "assembled" for cp in cps]

    async def ahead(i, protect=()):
        await store.assemble_ahead(cps[i].id, protect)
    asyncio.run(ahead(0))
    asyncio.run(ahead(1))
    os.utime(kept[0], (2000, 2000))
    os.utime(kept[1], (1000, 1000))  # the older one
    assert restored(store, cps[0].id, "state.mig") == images[0]  # a restore marks it as used now
    asyncio.run(ahead(2))  # a third is over the budget: the least recently used one goes
    assert [k.is_dir() for k in kept[:3]] == [True, False, True]
    assert restored(store, cps[1].id, "state.mig") == images[1]  # from its chunks again, not kept anew
    assert not kept[1].exists()

    async def while_restoring():
        async with store.restorable(cps[0].id) as d:
            os.utime(kept[0], (1, 1))  # the oldest, but read by this restore
            store.images.kept_bytes = 1
            dropped = store.evict_kept(protect={cps[2].id})  # and one a template's: kept
            return dropped, (d / "state.mig").read_bytes()
    assert asyncio.run(while_restoring()) == (0, images[0])
    assert kept[0].is_dir() and kept[2].is_dir()
    assert store.evict_kept(protect={cps[2].id}) == 1 and not kept[0].exists() and kept[2].is_dir()
    assert not list(store.items.glob("*/assembled.tmp-*"))  # a dropped image leaves nothing behind


def test_kept_images_give_way_when_the_disk_is_short_of_space(tmp_path):
    store = CheckpointStore(tmp_path / "ck", kept_bytes=64 * MiB)
    image = bytes(memory_like(30, 2 * MiB))
    cps = [take(store, "state.mig", image) for _ in range(2)]
    kept = [store.items / cp.id / "assembled" for cp in cps]
    free = store.images.free()
    store.images.keep_free = free  # keeping the image would leave less than this: not kept
    asyncio.run(ahead_of(store, cps[0].id))
    assert not kept[0].exists()
    assert restored(store, cps[0].id, "state.mig") == image  # from its chunks, as before
    store.images.keep_free = 0
    asyncio.run(ahead_of(store, cps[0].id))
    asyncio.run(ahead_of(store, cps[1].id))
    assert kept[0].is_dir() and kept[1].is_dir()
    os.utime(kept[0], (1000, 1000))  # the older one
    # Within the budget, but the disk now has less free than wanted: the oldest goes first.
    store.images.keep_free = store.images.free() + MiB
    assert store.evict_kept() == 1 and not kept[0].exists() and kept[1].is_dir()
    store.images.keep_free = store.images.free() + 64 * MiB
    assert store.evict_kept(spare=cps[1].id) == 0 and kept[1].is_dir()  # the one just made stays
    # A checkpoint taken now, with the disk short: its image is not kept, and the others give way.
    cp3 = take(store, "state.mig", image)
    asyncio.run(ahead_of(store, cp3.id))
    assert not kept[1].exists() and not (store.items / cp3.id / "assembled").exists()


def test_a_restore_cancelled_while_it_takes_a_kept_image_lets_go_of_it(tmp_path):
    store = CheckpointStore(tmp_path / "ck", kept_bytes=64 * MiB)
    cp = take(store, "state.mig", bytes(memory_like(31, MiB)))
    kept = store.items / cp.id / "assembled"
    entered, go_on = threading.Event(), threading.Event()
    real = store.images._assembled

    def held_up(cid, use=False):
        entered.set()
        go_on.wait(30)
        return real(cid, use)
    store.images._assembled = held_up

    async def cancelled_restore():
        async def restore():
            async with store.restorable(cp.id, keep=True):
                raise AssertionError("cancelled before it had the image")
        task = asyncio.ensure_future(restore())
        await asyncio.to_thread(entered.wait, 30)
        task.cancel()
        go_on.set()  # the thread finishes after the cancel and takes its hold
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(600):  # until the thread is done and the hold let go (bounded)
            if kept.is_dir() and not store.images._in_use:
                return
            await asyncio.sleep(0.05)
    asyncio.run(cancelled_restore())
    assert kept.is_dir() and store.images._in_use == {}
    store.images.kept_bytes = 1
    assert store.evict_kept() == 1 and not kept.exists()  # not pinned for the process's life


async def ahead_of(store, cid):
    return await store.assemble_ahead(cid)


def test_a_crashed_assembly_is_swept(tmp_path):
    store = CheckpointStore(tmp_path / "ck")
    cp = take(store, "state.mig", bytes(memory_like(14, MiB)))
    left = store.items / cp.id / "assembled.tmp-dead"
    left.mkdir()
    (left / "state.mig").write_bytes(b"partial")
    store.sweep()
    assert left.exists()  # young: perhaps another process's, still being written
    os.utime(left, (0, 0))
    store.sweep()
    assert not left.exists()
    assert (store.items / cp.id / "checkpoint.json").is_file()


def test_only_images_framed_as_runsc_writes_them_are_unwrapped(tmp_path):
    stream = bytes(memory_like(11, 3 * MiB))
    good = tmp_path / "good.img"
    good.write_bytes(gvisor_image(stream, {}))
    assert bytes(unwrap_gvisor(good)[1]) == stream
    odd = tmp_path / "odd.img"  # a short frame before the last: not runsc's; stored as it is
    image = gvisor_image(stream[:1000], {}) + gvisor_image(stream, {})[len(gvisor_image(b"", {})):]
    odd.write_bytes(image)
    assert unwrap_gvisor(odd) is None
    truncated = tmp_path / "truncated.img"
    truncated.write_bytes(gvisor_image(stream, {})[:-10])
    assert unwrap_gvisor(truncated) is None
    store = CheckpointStore(tmp_path / "ck")
    cp = take(store, "checkpoint.img", image)  # chunked as it is, and back byte for byte
    assert restored(store, cp.id, "checkpoint.img") == image


def chunk_files(store: CheckpointStore) -> set:
    return {p.name for p in store.chunks.root.glob("*/*")}


def test_sweep_keeps_what_a_checkpoint_needs_and_frees_the_rest(tmp_path):
    store = CheckpointStore(tmp_path / "ck")
    first = memory_like(6)
    cp1 = take(store, "state.mig", bytes(first))
    cp2 = take(store, "state.mig", bytes(small_change(first, 7)))
    k1, k2 = set(manifest_keys(store.state_dir(cp1.id))), set(manifest_keys(store.state_dir(cp2.id)))
    assert k1 & k2 and k1 - k2 and chunk_files(store) == k1 | k2
    store.discard(cp1.id)
    assert store.sweep() >= len(k1 - k2)
    assert chunk_files(store) == k2  # only cp1's own chunks went
    assert restored(store, cp2.id, "state.mig") == small_change(first, 7)
    store.discard(cp2.id)
    store.sweep()
    assert chunk_files(store) == set()


def test_an_unfinished_checkpoints_chunks_are_pinned(tmp_path):
    store = CheckpointStore(tmp_path / "ck")
    cid, _ = store.new_dir()
    store.state_dir(cid).mkdir()
    (store.state_dir(cid) / "state.mig").write_bytes(bytes(memory_like(8, MiB)))
    store.store_state(cid, "", ("state.mig",))
    keys = set(manifest_keys(store.state_dir(cid)))
    store.sweep()  # not committed yet, but open in this process: kept
    assert chunk_files(store) == keys
    store.discard(cid)
    store.sweep()
    assert chunk_files(store) == set()


def test_tenants_do_not_share_chunks(tmp_path):
    store = CheckpointStore(tmp_path / "ck")
    data = bytes(memory_like(9, 2 * MiB))
    a = take(store, "state.mig", data, owner="alice")
    b = take(store, "state.mig", data, owner="bob")
    assert b.stored_bytes == pytest.approx(a.stored_bytes, rel=0.01)  # bob's costs as much as alice's
    assert not set(manifest_keys(store.state_dir(a.id))) & set(manifest_keys(store.state_dir(b.id)))
    again = take(store, "state.mig", data, owner="alice")
    assert again.stored_bytes < 0.03 * a.stored_bytes  # alice's second copy: only its manifest (~86 B a chunk)


def test_old_whole_images_restore_as_they_are(tmp_path):
    store = CheckpointStore(tmp_path / "ck")
    cid, _ = store.new_dir()
    state = store.state_dir(cid)
    state.mkdir()
    (state / "checkpoint.img").write_bytes(b"whole image")
    record = {"id": cid, "sandbox": "sb", "created": 0, "state_bytes": 11, "files_bytes": 0, "new_bytes": 5}
    (store.items / cid / "checkpoint.json").write_text(json.dumps(record))  # a record from before chunking
    store._close(cid)
    cp = store.get(cid)
    assert cp.stored_bytes == 16  # it stored its whole image, and its files
    assert restored(store, cid, "checkpoint.img") == b"whole image"

    async def where():
        async with store.restorable(cid) as d:
            return d
    assert asyncio.run(where()) == state  # used in place, as before


def test_a_missing_chunk_is_named(tmp_path):
    store = CheckpointStore(tmp_path / "ck")
    cp = take(store, "state.mig", bytes(memory_like(10, MiB)))
    key = next(manifest_keys(store.state_dir(cp.id)))
    store.chunks.path(key).unlink()
    with pytest.raises(DamagedImage, match=key):
        restored(store, cp.id, "state.mig")
    assert not list((store.root / "restoring").iterdir())  # nothing left behind


def test_a_damaged_chunk_is_named(tmp_path):
    store = CheckpointStore(tmp_path / "ck")
    cp = take(store, "checkpoint.img", gvisor_image(bytes(memory_like(15, MiB)), {}))
    key = list(manifest_keys(store.state_dir(cp.id)))[3]
    path = store.chunks.path(key)
    path.write_bytes(os.urandom(path.stat().st_size))  # the same size: only decompressing tells
    with pytest.raises(DamagedImage, match=f"chunk {key} of checkpoint.img is damaged"):
        restored(store, cp.id, "checkpoint.img")
