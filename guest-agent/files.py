"""The workspace files API: every path walked beneath the workspace without
following a symlink, every operation done as the sandbox user."""

from __future__ import annotations

import contextlib
import errno
import os
import posixpath
import re
import stat
import uuid

try:
    from . import protocol as P
    from .privileges import ThreadCredentials
except ImportError:  # run as a script
    import protocol as P  # type: ignore
    from privileges import ThreadCredentials  # type: ignore


O_OPEN = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class WorkspaceFiles:
    """The files API, done so that the agent is no deputy for the code in the
    sandbox.

    The agent is root with CAP_DAC_OVERRIDE; the kernel's user controls every
    name in the workspace and can swap a directory for a symlink at any
    moment. So a path is never resolved and then opened: it is walked one
    component at a time from a descriptor of the workspace, each component
    opened with O_NOFOLLOW relative to the previous directory's descriptor
    and its type checked with fstat (``open_at``); the operation then works
    on descriptors only. A symlink anywhere is refused (even one pointing
    inside: it could be swapped afterwards), a FIFO or device is refused
    without blocking, and '..' is resolved by name, which is exact when no
    symlink is followed. (openat2's RESOLVE_BENEATH|RESOLVE_NO_SYMLINKS would
    do the walk in one call, but runsc 20221219 answers ENOSYS; the walk works
    everywhere, so it is the only path.)

    And every file operation runs as the sandbox user (``acting_as_user``), so
    its permissions are the kernel's own: a 0600 root file or a 0000 file is
    refused by the kernel's own check, as it would be for the cell."""

    def __init__(self, path: str, user: int | None):
        self.path = path
        self.user = user
        # Only a root agent serving another user switches; the tests' agent
        # runs as whoever started it, with no --user.
        self.switch = user is not None and user != 0 and os.geteuid() == 0
        self.egid, self.groups = os.getegid(), os.getgroups()
        self.creds = ThreadCredentials()

    @contextlib.contextmanager
    def acting_as_user(self):
        """Effective uid/gid of the sandbox user, and no supplementary groups,
        for the duration of one file operation.

        Credentials are per thread in Linux; glibc's set*id (what os.setresuid
        calls) applies them to every thread, the raw system calls only to the
        calling one (``ThreadCredentials``). Either is safe here because every
        file operation runs synchronously on the event loop's thread, with no
        await between the switch and its undo: no other task of the agent can
        run as the user meanwhile (a kernel spawn would fail), and the other
        threads (stdin reader, zmq I/O) only move bytes on descriptors they
        already hold. Real and saved uid stay 0, which is how the effective
        uid comes back, and which keeps the kernel's user from signalling or
        tracing the agent meanwhile (both check the target's real and saved
        uid). With the raw calls the operations could move to a worker thread
        and stop blocking the loop on big files; with the glibc fallback they
        could not, so they stay on the loop, as they always were."""
        if not self.switch:
            yield
            return
        creds = self.creds
        try:
            if self.groups:
                creds.setgroups([])
            creds.setresgid(-1, self.user, -1)
            creds.setresuid(-1, self.user, -1)
            yield
        finally:
            creds.setresuid(-1, 0, -1)
            creds.setresgid(-1, self.egid, -1)
            if self.groups:
                creds.setgroups(self.groups)

    @staticmethod
    def components(path: str) -> list[str]:
        norm = posixpath.normpath(path.lstrip("/"))
        if norm == ".":
            return []
        if norm == ".." or norm.startswith("../"):
            raise PermissionError(f"{path!r} is outside the workspace")
        return norm.split("/")

    @staticmethod
    def open_at(dfd: int, name: str, path: str, directory: bool) -> int:
        """Open ``name`` in the directory ``dfd`` without following a symlink;
        a directory when ``directory``, otherwise a regular file.

        O_NOFOLLOW without O_DIRECTORY: given both, runsc 20221219 follows a
        symlink to a directory. So the type is checked on the descriptor, and
        O_NONBLOCK keeps the open of a FIFO from waiting for a writer."""
        try:
            fd = os.open(name, O_OPEN, dir_fd=dfd)
        except FileNotFoundError:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", path) from None
        except OSError as e:
            if e.errno == errno.ELOOP:  # with O_NOFOLLOW: the name is a symlink
                raise PermissionError(f"refusing to follow a symlink in {path!r}") from None
            raise
        mode = os.fstat(fd).st_mode
        if directory and not stat.S_ISDIR(mode):
            os.close(fd)
            raise NotADirectoryError(errno.ENOTDIR, "Not a directory", path)
        if not directory and not stat.S_ISREG(mode):
            os.close(fd)
            if stat.S_ISDIR(mode):
                raise IsADirectoryError(errno.EISDIR, "Is a directory", path)
            raise PermissionError(f"refusing to read {path!r}: not a regular file")
        return fd

    def open_dir(self, parts: list[str], path: str, create: bool = False) -> int:
        """A descriptor of the directory at ``parts`` beneath the workspace,
        no symlink followed; missing directories are made if ``create``."""
        fd = os.open(self.path, O_OPEN)
        try:
            for name in parts:
                try:
                    nfd = self.open_at(fd, name, path, directory=True)
                except FileNotFoundError:
                    if not create:
                        raise
                    try:
                        os.mkdir(name, 0o755, dir_fd=fd)
                    except FileExistsError:  # made meanwhile: whatever it is, open_at checks it
                        pass
                    nfd = self.open_at(fd, name, path, directory=True)
                os.close(fd)
                fd = nfd
            return fd
        except BaseException:
            os.close(fd)
            raise

    def read_file(self, path: str, offset: int = 0, length: int = 0) -> tuple:
        """(bytes, the file's stat): ``length`` bytes from ``offset``, or the whole file (length 0)."""
        parts = self.components(path)
        if not parts:
            raise IsADirectoryError(errno.EISDIR, "Is a directory", path)
        dfd = self.open_dir(parts[:-1], path)
        try:
            fd = self.open_at(dfd, parts[-1], path, directory=False)
        finally:
            os.close(dfd)
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if length:
                return os.pread(f.fileno(), min(length, P.MAX_PAYLOAD), max(0, offset)), st
            data = f.read(P.MAX_PAYLOAD + 1)
        if len(data) > P.MAX_PAYLOAD:
            raise P.ProtocolError(f"{path!r} is larger than a frame's payload ({P.MAX_PAYLOAD >> 20} MiB)")
        return data, st

    def write_file(self, path: str, data: bytes, mode: int) -> None:
        parts = self.components(path)
        if not parts:
            raise IsADirectoryError(errno.EISDIR, "Is a directory", path)
        name = parts[-1]
        dfd = self.open_dir(parts[:-1], path, create=True)
        try:
            self._writable_name(dfd, name, path)
            # Written to a temporary name and renamed: readers never see half a
            # file, and the rename replaces whatever entry is there by then
            # (even a symlink swapped in) without following it.
            # Not derived from the name: a name near the file system's 255-byte limit would push it past.
            tmp = f".sandgate-{uuid.uuid4().hex[:16]}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    # On disk before the write is acknowledged: a VM that is
                    # killed keeps what was acknowledged.
                    os.fsync(f.fileno())
                    os.fchmod(f.fileno(), mode & 0o777)  # never setuid, setgid or sticky
                os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            except BaseException:
                self._unlink_quietly(tmp, dfd)
                raise
            os.fsync(dfd)
        finally:
            os.close(dfd)

    UPLOAD = re.compile(r"[0-9a-f]{8,32}")

    def write_part(self, path: str, upload: str, offset: int, data: bytes, last: bool, mode: int) -> int:
        """One chunk of a file the gateway streams: appended at ``offset`` to the temporary file
        ``.sandgate-<upload>.part`` (made at offset 0; not named after the file, whose name may be
        as long as a name can be), renamed over the file with the last chunk,
        so readers never see half a file, as with write_file. Each chunk opens the temporary file
        again: nothing is held between two, and a checkpoint may come between them."""
        parts = self.components(path)
        if not parts:
            raise IsADirectoryError(errno.EISDIR, "Is a directory", path)
        if not self.UPLOAD.fullmatch(upload):
            raise ValueError(f"bad upload id {upload!r}")
        name = parts[-1]
        tmp = f".sandgate-{upload}.part"
        dfd = self.open_dir(parts[:-1], path, create=offset == 0)
        try:
            flags = os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_CREAT | os.O_EXCL if offset == 0 else 0)
            fd = os.open(tmp, flags, 0o600, dir_fd=dfd)
            try:
                with os.fdopen(fd, "wb") as f:
                    if offset == 0 or last:  # refused before the first byte, and checked again before the rename
                        self._writable_name(dfd, name, path)
                    if os.fstat(f.fileno()).st_size != offset:  # a chunk lost or repeated: not this file
                        raise ValueError(f"upload {upload} of {path!r} is at {os.fstat(f.fileno()).st_size}, not {offset}")
                    f.seek(offset)
                    f.write(data)
                    if last:
                        f.flush()
                        os.fsync(f.fileno())
                        os.fchmod(f.fileno(), mode & 0o777)  # never setuid, setgid or sticky
                if last:
                    # Replaces whatever entry is there by then (even a symlink swapped in) without following it.
                    os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
                    os.fsync(dfd)
            except BaseException:
                self._unlink_quietly(tmp, dfd)
                raise
        finally:
            os.close(dfd)
        return offset + len(data)

    @staticmethod
    def _writable_name(dfd: int, name: str, path: str) -> None:
        """A symlink is never written through, a directory never replaced (write_file, write_part)."""
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            return
        if stat.S_ISLNK(st.st_mode):
            raise PermissionError(f"refusing to write through the symlink {path!r}")
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(errno.EISDIR, "Is a directory", path)

    def abort_part(self, path: str, upload: str) -> None:
        """An upload that will not finish: its temporary file goes."""
        parts = self.components(path)
        if not parts or not self.UPLOAD.fullmatch(upload):
            return
        try:
            dfd = self.open_dir(parts[:-1], path)
        except OSError:
            return
        try:
            self._unlink_quietly(f".sandgate-{upload}.part", dfd)
        finally:
            os.close(dfd)

    @staticmethod
    def _unlink_quietly(name: str, dfd: int) -> None:
        """A temporary file of ours goes; one already gone (or never made) is no error."""
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=dfd)

    def directory(self, path: str) -> int:
        return self.open_dir(self.components(path), path)

    def list_dir(self, path: str) -> list[dict]:
        fd = self.directory(path)
        entries = []
        try:
            with os.scandir(fd) as it:
                for e in it:
                    try:
                        st = e.stat(follow_symlinks=False)
                    except FileNotFoundError:  # gone since the listing was read
                        continue
                    kind = ("directory" if stat.S_ISDIR(st.st_mode) else
                            "symlink" if stat.S_ISLNK(st.st_mode) else "file")
                    entries.append({"name": e.name, "type": kind, "size": st.st_size, "mtime": st.st_mtime})
        finally:
            os.close(fd)
        return sorted(entries, key=lambda e: e["name"])

    def delete(self, path: str) -> None:
        parts = self.components(path)
        if not parts:
            raise PermissionError("refusing to delete the workspace itself")
        dfd = self.open_dir(parts[:-1], path)
        try:
            try:
                st = os.stat(parts[-1], dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                raise FileNotFoundError(errno.ENOENT, "No such file or directory", path) from None
            if stat.S_ISDIR(st.st_mode):
                self._rmtree(dfd, parts[-1], path)
            else:  # a symlink goes itself, never what it points to
                os.unlink(parts[-1], dir_fd=dfd)
        finally:
            os.close(dfd)

    def _rmtree(self, dfd: int, name: str, path: str) -> None:
        """Like shutil.rmtree with dir_fd, but every directory is opened with
        open_at: an entry swapped for a FIFO or a symlink meanwhile fails the
        delete instead of blocking or being followed. Iterative, with one
        descriptor per level held: a tree deeper than Python's recursion
        limit (a cell makes one in a second) is deleted like any other."""
        stack = [(dfd, name, self.open_at(dfd, name, path, directory=True), None)]
        try:
            while stack:
                parent, dname, fd, entries = stack[-1]
                if entries is None:
                    with os.scandir(fd) as it:
                        entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
                    stack[-1] = (parent, dname, fd, entries)
                if entries:
                    child, is_dir = entries.pop()
                    if is_dir:
                        stack.append((fd, child, self.open_at(fd, child, path, directory=True), None))
                    else:
                        os.unlink(child, dir_fd=fd)
                    continue
                stack.pop()
                os.close(fd)
                os.rmdir(dname, dir_fd=parent)
        finally:
            for _, _, fd, _ in stack:
                os.close(fd)

    def run(self, fn, path: str, *args):
        """One file operation as the sandbox user. What that user may not do
        is refused (403 at the gateway), like what is outside the workspace."""
        try:
            with self.acting_as_user():
                return fn(path, *args)
        except PermissionError as e:
            if e.errno in (errno.EACCES, errno.EPERM):
                raise PermissionError(f"refusing {path!r}: permission denied to the sandbox user") from None
            raise
