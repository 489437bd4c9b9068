"""The checkpoint store's pieces on their own (gateway/checkpoints/): sparse I/O (sparse.py), the
records on disk (catalog.py) and what a sweep must leave (pins.py). CheckpointStore with all of
them together: tests/test_checkpoint_store.py and tests/test_state_chunks.py."""

from __future__ import annotations

import asyncio
import hashlib
import os
import threading
import time

import pytest

from sandgate.checkpoints.catalog import Catalog
from sandgate.checkpoints.pins import SHARED_GRACE, Pins
from sandgate.checkpoints.records import Checkpoint
from sandgate.checkpoints.sparse import (Cancelled, Changed, copy_sparse, extents, hash_file, is_sparse, read_small,
                                         stored_bytes)

MiB = 1 << 20


def sparse_file(path, size: int, pieces: dict) -> bytes:
    """A file of ``size`` bytes, holes but for ``pieces`` (offset: bytes); its logical content."""
    with open(path, "wb") as f:
        f.truncate(size)
        for off, data in pieces.items():
            f.seek(off)
            f.write(data)
    content = bytearray(size)
    for off, data in pieces.items():
        content[off:off + len(data)] = data
    return bytes(content)


@pytest.fixture
def holey(tmp_path):
    path = tmp_path / "holey"
    content = sparse_file(path, 8 * MiB, {0: b"a" * 4096, 5 * MiB: os.urandom(8192)})
    st = os.stat(path)
    if not is_sparse(st):
        pytest.skip("this filesystem keeps no holes")
    return path, content


# -- sparse.py -------------------------------------------------------------------

def test_extents_cover_the_data_and_skip_the_holes(holey):
    path, content = holey
    fd = os.open(path, os.O_RDONLY)
    try:
        ranges = list(extents(fd, len(content), sparse=True))
        assert list(extents(fd, len(content), sparse=False)) == [(0, len(content))]
    finally:
        os.close(fd)
    assert ranges == sorted(ranges) and all(a < b for a, b in ranges)
    covered = sum(b - a for a, b in ranges)
    assert covered < 2 * MiB  # far from the 8 MiB the file says it holds
    rest = bytearray(content)
    for a, b in ranges:
        rest[a:b] = bytes(b - a)
    assert rest == bytes(len(content))  # every data byte is inside a range: what is skipped is holes

def test_hash_and_copy_keep_the_holes_and_the_bytes(holey, tmp_path):
    path, content = holey
    src = os.open(path, os.O_RDONLY)
    dst_path = tmp_path / "copy"
    dst = os.open(dst_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        sha, data = hash_file(src, os.fstat(src), bytearray(MiB), None)
        copied = copy_sparse(src, dst, len(content), True, bytearray(MiB), None)
    finally:
        os.close(src)
        os.close(dst)
    assert sha == hashlib.sha256(content).hexdigest()  # holes hashed as the zeros they read as
    assert data == copied and 12288 <= data < 2 * MiB
    assert dst_path.read_bytes() == content
    assert is_sparse(os.stat(dst_path)) and stored_bytes([dst_path]) < 2 * MiB
    assert stored_bytes([dst_path, tmp_path / "missing"]) == stored_bytes([dst_path])


def test_a_set_cancel_stops_a_hash_and_a_file_that_grew_is_noticed(holey, tmp_path):
    path, _ = holey
    cancel = threading.Event()
    cancel.set()
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(Cancelled):
            hash_file(fd, os.fstat(fd), bytearray(MiB), cancel)
    finally:
        os.close(fd)
    small = tmp_path / "small"
    small.write_bytes(b"12345")
    fd = os.open(small, os.O_RDONLY)
    try:
        assert read_small(fd, 5) == b"12345"
        with pytest.raises(Changed):
            read_small(fd, 4)  # the size it was told is not the size it found
    finally:
        os.close(fd)


# -- catalog.py ------------------------------------------------------------------

def record(cid: str, sandbox: str = "sb", owner: str = "", created: float = 0.0) -> Checkpoint:
    return Checkpoint(id=cid, sandbox=sandbox, owner=owner, created=created, state_bytes=0, files_bytes=0,
                      new_bytes=0)


def test_the_catalog_lists_only_checkpoints_with_a_record(tmp_path):
    cat = Catalog(tmp_path / "items")
    for cid, sandbox, owner, created in (("b", "s1", "", 2.0), ("a", "s1", "t", 1.0), ("c", "s2", "t", 3.0)):
        cat.make_dir(cid)
        cat.write(record(cid, sandbox, owner, created))
    cat.make_dir("unfinished")
    assert [c.id for c in cat.list()] == ["a", "b", "c"]  # oldest first
    assert [c.id for c in cat.list(sandbox="s1")] == ["a", "b"]
    assert [c.id for c in cat.list(owner="t")] == ["a", "c"]
    assert cat.get("b").sandbox == "s1" and not list(cat.items.glob("*/*.tmp"))
    for bad in ("unfinished", "nonesuch", "../items/a"):
        with pytest.raises(KeyError):
            cat.get(bad)
    assert cat.unfinished(lambda cid: False, lambda path: True) == [cat.items / "unfinished"]
    assert cat.unfinished(lambda cid: cid == "unfinished", lambda path: True) == []

    cat.write(record("b", "s1", "", 5.0))  # rewritten in place
    assert [c.id for c in cat.list()] == ["a", "c", "b"]
    assert cat.unlist("a").id == "a"
    assert [c.id for c in cat.list()] == ["c", "b"] and (cat.items / "a").is_dir()
    cat.remove_dir("a")
    assert not (cat.items / "a").exists()


# -- pins.py ---------------------------------------------------------------------

def test_pins_last_while_their_checkpoint_is_open():
    pins = Pins()
    assert pins.pin("c1", {"k1"}, "c1") is False and pins.pinned() == set()  # never opened: nothing pinned
    pins.open("c1")
    assert pins.pin("c1", {"k1"}, "c1") and pins.pinned() == {"k1"}
    pins.close("c1")
    assert pins.pinned() == set() and not pins.is_open("c1")


def test_a_snapshot_without_a_checkpoint_keeps_its_pins_until_nothing_is_open():
    pins = Pins()
    pins.open("c1")
    pins.started()
    pins.pin("snap", {"k"})
    pins.finished("snap", loose=True)
    assert pins.pinned() == {"k"}  # c1 may be the checkpoint it was for
    pins.close("c1")
    assert pins.pinned() == set()

    pins.started()
    pins.pin("bad", {"x"})
    pins.failed("bad")
    assert pins.pinned() == set()


def test_only_a_shared_store_waits_for_what_another_node_may_be_writing(tmp_path):
    f = tmp_path / "f"
    f.write_text("x")
    assert Pins(shared=False).old(f) and Pins(shared=False).old(tmp_path / "missing")
    shared = Pins(shared=True)
    assert not shared.old(f) and not shared.old(tmp_path / "missing")
    then = time.time() - SHARED_GRACE - 60
    os.utime(f, (then, then))
    assert shared.old(f)


# -- replica.py ------------------------------------------------------------------

def test_a_checkpoint_copied_to_a_bucket_is_whole_on_another_node(tmp_path, monkeypatch):
    """Node a commits a checkpoint (workspace files, a chunked image); node b, with its own
    directory and the same bucket (moto's, in process), fetches it and restores both."""
    boto3 = pytest.importorskip("boto3")
    moto = pytest.importorskip("moto")
    from sandgate.checkpoints import CheckpointStore
    from sandgate.checkpoints.replica import S3Replica

    for var, value in (("AWS_ACCESS_KEY_ID", "test"), ("AWS_SECRET_ACCESS_KEY", "test"),
                       ("AWS_DEFAULT_REGION", "us-east-1")):
        monkeypatch.setenv(var, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "notes.txt").write_text("x = 41")
    image = os.urandom(64 << 10) * 8  # repeats: chunked and deduplicated
    with moto.mock_aws():
        s3 = boto3.client("s3")
        s3.create_bucket(Bucket="sandgate-test")
        a = CheckpointStore(tmp_path / "a", replica=S3Replica("s3://sandgate-test/fleet", client=s3))
        b = CheckpointStore(tmp_path / "b", replica=S3Replica("s3://sandgate-test/fleet", client=s3))
        cid, _ = a.new_dir()
        files, new = a.snapshot(ws, cid=cid, owner="t")
        state = a.state_dir(cid)
        state.mkdir()
        (state / "checkpoint.img").write_bytes(image)
        state_bytes, stored = a.store_state(cid, "t", ("checkpoint.img",))
        a.commit(Checkpoint(id=cid, sandbox="sb", owner="t", created=time.time(), state_bytes=state_bytes,
                            files_bytes=6, new_bytes=new, stored_bytes=stored, files=files))

        assert b.fetch(cid).files == files and b.get(cid).owner == "t"
        assert a.fetch(cid) is None  # a has it: nothing fetched
        b.materialize(b.get(cid), tmp_path / "restored")
        assert (tmp_path / "restored" / "notes.txt").read_text() == "x = 41"

        async def image_of(store):
            async with store.restorable(cid) as d:
                return (d / "checkpoint.img").read_bytes()
        assert asyncio.run(image_of(b)) == image

        assert a.gc(set(), set()) >= 1  # dropped here and in the bucket
        c = CheckpointStore(tmp_path / "c", replica=S3Replica("s3://sandgate-test/fleet", client=s3))
        assert c.fetch(cid) is None and c.list() == []
