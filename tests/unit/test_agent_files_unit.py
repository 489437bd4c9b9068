"""The guest agent's files API (``WorkspaceFiles`` in sandgate_agent/files.py),
in process on a real directory: no sandbox, no gateway. The agent is root
inside a sandbox and the kernel's user owns every name in the workspace, so
each operation must stay beneath it (no '..' out, no symlink followed, no
FIFO opened), never write through a symlink or over a directory, keep
half-written files out of sight, and honour its bounds. The end-to-end
counterparts (a racer swapping symlinks under a real gateway) are in
tests/security/test_agent_files.py."""

import errno
import os
import shutil
import stat
import tempfile

import pytest

from sandgate_agent import protocol as P
from sandgate_agent.files import WorkspaceFiles


@pytest.fixture
def ws(tmp_path):
    """A workspace beside a directory outside it that holds a secret."""
    root = tmp_path / "workspace"
    root.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("secret")
    return WorkspaceFiles(str(root), None), root, outside


def names(d):
    return sorted(os.listdir(d))


# -- path traversal -------------------------------------------------------------

@pytest.mark.parametrize("path", ["..", "../outside/secret", "/../outside/secret", "a/../../outside/secret",
                                  "./../outside", "a/b/../../../outside/secret"])
def test_a_path_out_of_the_workspace_is_refused_for_every_operation(ws, path):
    files, root, outside = ws
    (root / "a" / "b").mkdir(parents=True)
    for op, args in ((files.read_file, ()), (files.write_file, (b"x", 0o644)), (files.list_dir, ()),
                     (files.delete, ()), (files.directory, ()),
                     (files.write_part, ("0123456789abcdef", 0, b"x", True, 0o644))):
        with pytest.raises(PermissionError, match="outside the workspace"):
            op(path, *args)
    assert (outside / "secret").read_text() == "secret" and names(outside) == ["secret"]


def test_paths_are_normalised_beneath_the_workspace(ws):
    files, root, _ = ws
    assert files.components("/") == [] and files.components("") == [] and files.components("./.") == []
    assert files.components("/a//b/./c/") == ["a", "b", "c"]
    assert files.components("a/x/../b") == ["a", "b"]  # '..' by name is exact: no symlink is ever followed
    # An absolute path is the workspace's, never the guest's root.
    files.write_file("/etc/passwd", b"mine", 0o644)
    assert (root / "etc" / "passwd").read_bytes() == b"mine"


# -- symlinks -------------------------------------------------------------------

def test_a_symlinked_directory_anywhere_in_the_path_is_never_followed(ws):
    files, root, outside = ws
    (root / "out").symlink_to(outside)
    (root / "in").mkdir()
    (root / "in" / "f").write_text("inside")
    (root / "inner").symlink_to(root / "in")  # pointing inside is refused too: it could be swapped afterwards
    for link in ("out", "inner"):
        with pytest.raises(PermissionError, match="refusing to follow a symlink"):
            files.read_file(f"{link}/secret" if link == "out" else f"{link}/f")
        with pytest.raises(PermissionError, match="refusing to follow a symlink"):
            files.list_dir(link)
        with pytest.raises(PermissionError, match="refusing to follow a symlink"):
            files.write_file(f"{link}/new", b"x", 0o644)
        with pytest.raises(PermissionError, match="refusing to follow a symlink"):
            files.write_part(f"{link}/new", "0123456789abcdef", 0, b"x", True, 0o644)
        with pytest.raises(PermissionError, match="refusing to follow a symlink"):
            files.delete(f"{link}/secret")
    assert names(outside) == ["secret"] and names(root / "in") == ["f"]


def test_a_symlink_as_the_file_is_neither_read_nor_written_through(ws):
    files, root, outside = ws
    (root / "link").symlink_to(outside / "secret")
    with pytest.raises(PermissionError, match="refusing to follow a symlink"):
        files.read_file("link")
    with pytest.raises(PermissionError, match="refusing to write through the symlink"):
        files.write_file("link", b"overwritten", 0o644)
    with pytest.raises(PermissionError, match="refusing to write through the symlink"):
        files.write_part("link", "0123456789abcdef", 0, b"overwritten", True, 0o644)
    assert (outside / "secret").read_text() == "secret"
    assert os.path.islink(root / "link") and names(root) == ["link"]  # no temporary file left behind


def test_a_symlink_swapped_in_before_the_last_chunk_is_replaced_not_followed(ws):
    files, root, outside = ws
    upload = "0123456789abcdef"
    files.write_part("f", upload, 0, b"abc", False, 0o644)
    (root / "f").symlink_to(outside / "secret")
    with pytest.raises(PermissionError, match="refusing to write through the symlink"):
        files.write_part("f", upload, 3, b"def", True, 0o644)
    assert (outside / "secret").read_text() == "secret" and names(root) == ["f"]  # the upload's file is gone


def test_deleting_a_symlink_removes_the_link_and_a_tree_never_follows_its_links(ws):
    files, root, outside = ws
    (root / "link").symlink_to(outside)
    files.delete("link")
    assert names(root) == [] and names(outside) == ["secret"]
    (root / "tree" / "sub").mkdir(parents=True)
    (root / "tree" / "sub" / "out").symlink_to(outside)
    (root / "tree" / "sub" / "file").write_text("x")
    os.mkfifo(root / "tree" / "fifo")
    files.delete("tree")
    assert names(root) == [] and names(outside) == ["secret"]


# -- what is at the path --------------------------------------------------------

def test_a_directory_at_the_write_target_is_never_replaced(ws):
    files, root, _ = ws
    (root / "d").mkdir()
    (root / "d" / "kept").write_text("kept")
    with pytest.raises(IsADirectoryError):
        files.write_file("d", b"x", 0o644)
    with pytest.raises(IsADirectoryError):
        files.write_part("d", "0123456789abcdef", 0, b"x", False, 0o644)
    assert names(root) == ["d"] and names(root / "d") == ["kept"]
    # One made between the first chunk and the last: refused at the last, the upload's file removed.
    files.write_part("e", "0123456789abcdef", 0, b"x", False, 0o644)
    (root / "e").mkdir()
    with pytest.raises(IsADirectoryError):
        files.write_part("e", "0123456789abcdef", 1, b"y", True, 0o644)
    assert names(root) == ["d", "e"] and names(root / "e") == []


def test_the_workspace_root_is_neither_a_file_nor_deletable(ws):
    files, root, _ = ws
    for op, args in ((files.read_file, ()), (files.write_file, (b"x", 0o644)),
                     (files.write_part, ("0123456789abcdef", 0, b"x", True, 0o644))):
        with pytest.raises(IsADirectoryError):
            op("/", *args)
    with pytest.raises(PermissionError, match="the workspace itself"):
        files.delete("/")
    assert root.is_dir()


def test_a_fifo_is_refused_without_blocking_and_a_missing_file_names_its_path(ws):
    files, root, _ = ws
    os.mkfifo(root / "fifo")  # opening it for reading would wait for a writer forever
    with pytest.raises(PermissionError, match="not a regular file"):
        files.read_file("fifo")
    with pytest.raises(NotADirectoryError):
        files.list_dir("fifo")
    (root / "file").write_text("x")
    with pytest.raises(NotADirectoryError):
        files.read_file("file/below")
    with pytest.raises(FileNotFoundError) as e:
        files.read_file("no/such/file")
    assert e.value.errno == errno.ENOENT and e.value.filename == "no/such/file"
    with pytest.raises(FileNotFoundError):
        files.delete("nothing")


def test_a_listing_says_what_each_entry_is_without_following_links(ws):
    files, root, outside = ws
    (root / "b_dir").mkdir()
    (root / "a_file").write_bytes(b"12345")
    (root / "c_link").symlink_to(outside)
    got = files.list_dir("/")
    assert [(e["name"], e["type"]) for e in got] == [("a_file", "file"), ("b_dir", "directory"), ("c_link", "symlink")]
    assert got[0]["size"] == 5


# -- ranges and bounds ----------------------------------------------------------

def test_ranged_reads_give_what_is_there_and_the_whole_file_has_a_bound(ws, monkeypatch):
    files, root, _ = ws
    (root / "f").write_bytes(b"0123456789")
    data, st = files.read_file("f")
    assert data == b"0123456789" and st.st_size == 10
    assert files.read_file("f", 3, 4)[0] == b"3456"
    assert files.read_file("f", 8, 100)[0] == b"89"  # past the end: what there is
    assert files.read_file("f", 20, 5)[0] == b""
    assert files.read_file("f", -5, 3)[0] == b"012"  # a negative offset is the start
    monkeypatch.setattr(P, "MAX_PAYLOAD", 4)
    assert files.read_file("f", 0, 100)[0] == b"0123"  # a range is cut to one frame's payload
    with pytest.raises(P.ProtocolError, match="larger than a frame's payload"):
        files.read_file("f")  # a whole file must fit one frame


def test_a_write_replaces_the_file_whole_with_its_mode_and_no_special_bits(ws):
    files, root, _ = ws
    (root / "f").write_text("old")
    files.write_file("a/b/f", b"new", 0o4755 | 0o2000 | 0o1000)
    assert (root / "a" / "b" / "f").read_bytes() == b"new"
    assert stat.S_IMODE(os.stat(root / "a" / "b" / "f").st_mode) == 0o755
    files.write_file("f", b"replaced", 0o600)
    assert (root / "f").read_bytes() == b"replaced" and stat.S_IMODE(os.stat(root / "f").st_mode) == 0o600
    long_name = "n" * 255  # as long as a name may be: the temporary name is not derived from it
    files.write_file(long_name, b"x", 0o644)
    files.write_part(long_name, "0123456789abcdef", 0, b"y", True, 0o644)
    assert (root / long_name).read_bytes() == b"y"
    assert names(root) == sorted(["a", "f", long_name])


def test_chunks_build_the_file_out_of_sight_until_the_last_one(ws):
    files, root, _ = ws
    (root / "f").write_text("old")
    upload = "0123456789abcdef"
    assert files.write_part("f", upload, 0, b"abc", False, 0o640) == 3
    assert files.write_part("f", upload, 3, b"def", False, 0o640) == 6
    assert (root / "f").read_text() == "old"  # readers see the old file until the last chunk
    assert files.write_part("f", upload, 6, b"g", True, 0o640) == 7
    assert (root / "f").read_bytes() == b"abcdefg" and stat.S_IMODE(os.stat(root / "f").st_mode) == 0o640
    assert names(root) == ["f"]


def test_a_chunk_lost_or_repeated_ends_the_upload_and_bad_ids_are_refused(ws):
    files, root, _ = ws
    files.write_part("f", "aaaaaaaa", 0, b"abc", False, 0o644)
    with pytest.raises(ValueError, match="is at 3, not 5"):
        files.write_part("f", "aaaaaaaa", 5, b"x", False, 0o644)  # one lost
    assert names(root) == []  # its temporary file is gone with it
    files.write_part("f", "bbbbbbbb", 0, b"abc", False, 0o644)
    with pytest.raises(ValueError, match="is at 3, not 2"):
        files.write_part("f", "bbbbbbbb", 2, b"c", False, 0o644)  # one repeated
    with pytest.raises(FileNotFoundError):
        files.write_part("f", "bbbbbbbb", 3, b"d", True, 0o644)  # nothing to go on with
    files.write_part("f", "cccccccc", 0, b"abc", False, 0o644)
    with pytest.raises(FileExistsError):
        files.write_part("f", "cccccccc", 0, b"abc", False, 0o644)  # a second start of one upload
    for bad in ("short", "../../etc/x", "0123456789ABCDEF", "0" * 33, "a/b/c/d/e"):
        with pytest.raises(ValueError, match="bad upload id"):
            files.write_part("g", bad, 0, b"x", True, 0o644)
    files.abort_part("f", "cccccccc")
    files.abort_part("f", "../nothing")  # a bad id or path aborts nothing, quietly
    files.abort_part("no/such/dir/f", "cccccccc")
    assert names(root) == []


def test_a_tree_deeper_than_the_recursion_limit_is_deleted(ws):
    files, root, _ = ws
    depth = 1200  # past Python's recursion limit (1000), and past PATH_MAX as a path
    fd = os.open(root, os.O_RDONLY)
    try:
        for i in range(depth):
            os.mkdir("d", dir_fd=fd)
            nfd = os.open("d", os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = nfd
            os.close(os.open("f", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd))
    finally:
        os.close(fd)
    files.delete("d")
    assert names(root) == []


# -- as the sandbox user ----------------------------------------------------------

@pytest.mark.skipif(os.geteuid() != 0, reason="switching to the sandbox user needs root")
def test_every_operation_runs_as_the_sandbox_user_and_comes_back_to_root():
    base = tempfile.mkdtemp(prefix="sg-files-")
    try:
        os.chmod(base, 0o755)  # the user can reach the workspace, as in a sandbox
        root = os.path.join(base, "workspace")
        os.mkdir(root)
        user = 65534
        os.chown(root, user, user)
        files = WorkspaceFiles(root, user)
        with open(os.path.join(root, "root-only"), "w") as f:
            f.write("root's")
        os.chmod(os.path.join(root, "root-only"), 0o600)
        with pytest.raises(PermissionError, match="permission denied to the sandbox user"):
            files.run(files.read_file, "root-only")
        os.mkdir(os.path.join(root, "root-dir"), 0o755)  # root's, in the user's workspace
        with pytest.raises(PermissionError, match="permission denied to the sandbox user"):
            files.run(files.write_file, "root-dir/f", b"x", 0o644)
        assert os.listdir(os.path.join(root, "root-dir")) == []
        assert os.geteuid() == 0 and os.getegid() == 0  # the agent is itself again after a refusal
        files.run(files.write_file, "mine", b"mine", 0o644)
        assert os.stat(os.path.join(root, "mine")).st_uid == user
        assert files.run(files.read_file, "mine")[0] == b"mine"
        assert os.geteuid() == 0 and os.getegid() == 0
    finally:
        shutil.rmtree(base)
