"""Local and network filesystems through POSIX (and Windows) file calls.

Durability: every file is fsynced before ``write_file`` returns, and so is its folder
(where the OS allows: Windows and some filesystems refuse folder fsync, which is then
skipped). While a file is written, the kernel is asked to start writing it to the disk
every 16 MiB (``sync_file_range`` on Linux): the disk works while the rest is copied,
instead of after, and the fsync then waits for the little left. Files are created with ``O_EXCL`` directly under their final name and the
process umask applies; nothing is staged elsewhere and the commit protocol renames
nothing (``rename`` is for exports, which put finished files in place).

``open_replace`` (a file another tool reads under a fixed name) writes a temporary
name in the same folder (never ``$TMPDIR``: a rename across filesystems is a copy),
fsyncs it, renames it over the name and fsyncs the folder, so the new file is durable
before it is visible. Where the folder cannot be fsynced (Windows), the new file is
flushed once more after the rename, which commits the metadata journal. A rename
refused with ``PermissionError`` (Windows, while another process holds the file open)
is retried for a few seconds. A filesystem that refuses rename altogether (object-store
FUSE mounts) gets the complete temporary file copied under the final name, opened with
``O_TRUNC``: such a mount uploads the new object when the file is closed and shows the
old one until then (a power cut keeps the old one; a process killed during the copy
may leave the mount uploading the part it had, which is why a reader checks what it
reads).

What is read: only regular files, never through a symbolic link, below the folder that
was opened (``anchor``): a listing shows regular files and folders and nothing else
(FIFOs, sockets, devices and symlinks are left out), and a read refuses anything else
without blocking. ``follow_symlinks=True`` (a storage option) lifts the symlink rule,
for folders that are made of links, such as a Hugging Face cache.

Every OS call goes through a small file-system object (``fs``), by default
``OS_FILESYSTEM``, which calls the ``os`` module at call time (so tests that
monkeypatch ``os.fsync`` and friends still reach this code). ``safeckpt.testing``
passes a simulated disk instead to crash and power-cut saves on purpose.
"""

from __future__ import annotations

import ctypes
import errno
import io
import os
import stat
import sys
import time
from types import TracebackType
from typing import Any, Iterable, Protocol

from ..errors import CorruptCheckpointError, StorageError
from .base import Buffer, Replacement, Storage, storage_error
from ..format.names import is_replace_temp, replace_temp_name
from .mounts import warn_if_fsync_is_weak

_NO_DIR_FSYNC = {errno.EINVAL, errno.ENOTSUP, errno.EBADF, errno.EACCES, errno.EPERM, errno.EISDIR}
_NO_RENAME = {errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS}
_MAX_WRITE = 1 << 30
_GATHER = 1 << 20  # small writes (torch.save's record headers) are gathered into one system call
#: seconds to wait before each retry of a rename refused with PermissionError (about 3 s
#: in all): on Windows another process (a reader, an indexer, an antivirus) may hold the
#: file open for a moment
REPLACE_RETRY_DELAYS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6)
_COPY_BLOCK = 8 << 20


class _FileStat(Protocol):
    @property
    def st_mode(self) -> int: ...


class _FileReader(Protocol):
    """What ``open_reader`` returns: a binary reader used as a context manager."""

    def seek(self, offset: int, whence: int = 0, /) -> int: ...

    def readinto(self, out: memoryview, /) -> int | None: ...

    def __enter__(self) -> Any: ...

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> Any: ...


class FileSystem(Protocol):
    """The file calls ``LocalStorage`` makes: ``OSFileSystem`` or a stand-in such as
    ``safeckpt.testing.SimulatedDisk`` (duck-typed, no common base class)."""

    @property
    def name(self) -> str: ...

    def open(self, path: str, flags: int, mode: int = 0o777) -> int: ...

    def write(self, fd: int, data: Buffer) -> int: ...

    def fsync(self, fd: int) -> None: ...

    def close(self, fd: int) -> None: ...

    def mkdir(self, path: str) -> None: ...

    def rmdir(self, path: str) -> None: ...

    def unlink(self, path: str) -> None: ...

    def isdir(self, path: str) -> bool: ...

    def scandir(self, path: str) -> Any: ...

    def lstat(self, path: str) -> _FileStat: ...

    def open_reader(self, path: str, follow_symlinks: bool = False) -> _FileReader: ...

    def replace(self, src: str, dst: str) -> None: ...


class OSFileSystem:
    """The real filesystem: the handful of ``os`` calls ``LocalStorage`` makes.

    Each method looks the ``os`` function up when called, so monkeypatching
    ``os.fsync``, ``os.open`` ... in tests keeps working. A replacement (such as
    ``safeckpt.testing.SimulatedDisk``) provides the same methods."""

    @property
    def name(self) -> str:
        """``os.name`` of the platform: ``"nt"`` skips folder fsync entirely."""
        return os.name

    def open(self, path: str, flags: int, mode: int = 0o777) -> int:
        return os.open(path, flags, mode)

    def write(self, fd: int, data: Buffer) -> int:
        return os.write(fd, data)

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def start_writeback(self, fd: int, offset: int, length: int) -> None:
        """Have the kernel start writing these bytes to the disk now (Linux's
        ``sync_file_range``, ``SYNC_FILE_RANGE_WRITE``), not when the file is fsynced:
        the disk then works while the rest of the file is copied into the page cache.
        A hint: durability is still the fsync's, and where the call is refused nothing
        changes."""
        if _sync_file_range is not None:
            _sync_file_range(fd, offset, length, 2)

    def close(self, fd: int) -> None:
        os.close(fd)

    def mkdir(self, path: str) -> None:
        os.mkdir(path)

    def rmdir(self, path: str) -> None:
        os.rmdir(path)

    def unlink(self, path: str) -> None:
        os.unlink(path)

    def isdir(self, path: str) -> bool:
        return os.path.isdir(path)

    def scandir(self, path: str) -> Any:
        """A context manager iterating entries with ``name``, ``is_dir()``, ``stat()``."""
        return os.scandir(path)

    def lstat(self, path: str) -> os.stat_result:
        return os.lstat(path)

    def open_reader(self, path: str, follow_symlinks: bool = False) -> io.FileIO:
        """An unbuffered binary reader (``seek``, ``readinto``) of a regular file. Never
        blocks on a FIFO; a symlink is refused (``ELOOP``) unless ``follow_symlinks``."""
        flags = os.O_RDONLY | getattr(os, "O_BINARY", 0) | getattr(os, "O_NONBLOCK", 0)
        if not follow_symlinks:
            flags |= getattr(os, "O_NOFOLLOW", 0)
            if not hasattr(os, "O_NOFOLLOW") and os.path.islink(path):
                raise OSError(errno.ELOOP, "is a symbolic link", path)
        fd = os.open(path, flags)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(errno.EINVAL, "not a regular file", path)
            return os.fdopen(fd, "rb", buffering=0)
        except BaseException:
            os.close(fd)
            raise

    def replace(self, src: str, dst: str) -> None:
        os.replace(src, dst)


def _writeback_call() -> Any:
    """libc's ``sync_file_range`` where there is one (Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        call = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (AttributeError, OSError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    call.restype = ctypes.c_int
    return call


_sync_file_range = _writeback_call()
OS_FILESYSTEM = OSFileSystem()
WRITEBACK_EVERY = 16 << 20  #: ``write_file`` starts the writeback of each this many bytes as they are written

_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def not_regular(path: str) -> str | None:
    """What the local ``path`` is, in words, when it is there but not a regular file
    (links followed): ``"a FIFO"``, ``"a folder"``, ...; None for a regular file or
    nothing. The words for what ``open_reader`` refuses to read."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return None
    if stat.S_ISREG(mode):
        return None
    return next((what for test, what in _KINDS if test(mode)), "not a regular file")


def fsync_folder(path: str, fs: FileSystem | None = None) -> bool:
    """Make a folder's entries durable; skipped where the platform cannot (returns
    whether the folder was synced)."""
    fs = fs or OS_FILESYSTEM
    if fs.name == "nt":
        return False
    try:
        fd = fs.open(path, os.O_RDONLY)
    except OSError as exc:
        if exc.errno in _NO_DIR_FSYNC:
            return False
        raise
    try:
        fs.fsync(fd)
    except OSError as exc:
        if exc.errno not in _NO_DIR_FSYNC:
            raise
        return False
    finally:
        fs.close(fd)
    return True


class _Writeback:
    """Starts the kernel's writeback of a file being written every ``WRITEBACK_EVERY``
    bytes (``start_writeback``, where the file system object has it). Without it the
    kernel holds a whole checkpoint dirty until its fsync, and then the disk starts:
    copying and writing one after the other made a 1 GiB save 1.6x slower than needed."""

    def __init__(self, fs: FileSystem, fd: int) -> None:
        self.call = getattr(fs, "start_writeback", None)  # a simulated disk has none
        self.fd = fd
        self.written = self.started = 0

    def wrote(self, n: int) -> None:
        self.written += n
        if self.call is not None and self.written - self.started >= WRITEBACK_EVERY:
            self.call(self.fd, self.started, self.written - self.started)
            self.started = self.written


def _write_all(fs: FileSystem, fd: int, data: Buffer) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = fs.write(fd, view[:_MAX_WRITE])
        view = view[n:]


class LocalStorage(Storage):
    """A folder on a local or network filesystem.

    ``fs`` replaces the OS calls (default: the real ``os``); see ``OSFileSystem``.
    ``anchor`` is the folder this one was reached from (``child``): no folder between
    them may be a symlink either."""

    atomic_write = False  # a reader may see a file before it is complete
    can_rename = True
    can_replace = True

    def __init__(self, path: str | os.PathLike, fs: FileSystem | None = None, *,
                 follow_symlinks: bool = False, anchor: str | None = None) -> None:
        self.fs = fs if fs is not None else OS_FILESYSTEM
        self.path = os.path.abspath(os.fspath(path))
        self.url = self.path
        self.follow_symlinks = follow_symlinks
        self.anchor = self.path if anchor is None else anchor
        self._inside: bool | None = None  # the folders from the anchor down are real folders

    def _full(self, name: str) -> str:
        return os.path.join(self.path, *name.split("/"))

    def child(self, name: str) -> "LocalStorage":
        return LocalStorage(self._full(name), fs=self.fs, follow_symlinks=self.follow_symlinks, anchor=self.anchor)

    def parent(self) -> "LocalStorage":
        return LocalStorage(os.path.dirname(self.path), fs=self.fs, follow_symlinks=self.follow_symlinks)

    def _real_folders(self, path: str) -> bool:
        """Every folder from the anchor down to ``path`` (exclusive) is a folder, not a link."""
        return self._first_link(path) is None

    def _first_link(self, path: str) -> str | None:
        """The first entry from the anchor down to ``path`` (exclusive) that is not a real
        folder (a symbolic link, most likely), or None when there is none."""
        if self.follow_symlinks:
            return None
        rel = os.path.relpath(os.path.dirname(path), self.anchor)
        if rel == ".":
            return None
        current = self.anchor
        for part in rel.split(os.sep):
            current = os.path.join(current, part)
            try:
                if not stat.S_ISDIR(self.fs.lstat(current).st_mode):
                    return current
            except FileNotFoundError:
                return None  # nothing below a missing folder can be reached either
            except OSError:
                return current
        return None

    def _refuse_links(self, path: str, action: str) -> None:
        """Writes and deletions never go through a symbolic link below the folder that was
        opened (docs/format.md §2.6): it would change another folder than the one named."""
        link = self._first_link(path)
        if link is not None:
            raise StorageError(
                f"cannot {action} {path}: {link} is a symbolic link (or not a folder) below {self.anchor}, and "
                "safeckpt never writes or deletes through one (it would change the folder the link points to); "
                "remove the link, or save elsewhere")

    def _is_inside(self) -> bool:
        if self._inside is None:
            self._inside = self._real_folders(os.path.join(self.path, "x"))
        return self._inside

    def _ensure_folder(self, folder: str) -> None:
        if self.fs.isdir(folder):
            return
        parent = os.path.dirname(folder)
        self._ensure_folder(parent)
        try:
            self.fs.mkdir(folder)
        except FileExistsError:
            return
        fsync_folder(parent, self.fs)

    def write_file(self, name: str, parts: Iterable[Buffer]) -> int:
        fs = self.fs
        path = self._full(name)
        written = 0
        self._refuse_links(path, "create")
        try:
            self._ensure_folder(os.path.dirname(path))
            if fs is OS_FILESYSTEM:
                warn_if_fsync_is_weak(os.path.dirname(path))
            fd = fs.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
        except FileExistsError:
            raise
        except OSError as exc:
            raise storage_error(exc, "create", path) from exc
        writeback = _Writeback(fs, fd)
        try:
            for part in parts:
                _write_all(fs, fd, part)
                written += len(part)
                writeback.wrote(len(part))
            fs.fsync(fd)  # on EIO: fail the save, never retry (the pages may be gone)
        except OSError as exc:
            raise storage_error(exc, "write", path) from exc
        finally:
            fs.close(fd)
        try:
            fsync_folder(os.path.dirname(path), fs)
        except OSError as exc:
            raise storage_error(exc, "sync the folder of", path) from exc
        return written

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        path = self._full(name)
        try:
            if not (self._is_inside() and ("/" not in name or self._real_folders(path))):
                raise OSError(errno.ELOOP, "reached through a symbolic link", path)
            with self.fs.open_reader(path, self.follow_symlinks) as f:
                f.seek(offset)
                view = out.cast("B") if out.format != "B" else out
                while view:
                    n = f.readinto(view)
                    if not n:
                        raise EOFError(f"{path} ends before byte {offset + len(out)}")
                    view = view[n:]
        except FileNotFoundError:
            raise
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.EINVAL, errno.ENXIO):
                raise CorruptCheckpointError(
                    f"{path} is a symbolic link or not a regular file: safeckpt reads only regular "
                    "files inside the checkpoint folder (pass storage_options={'follow_symlinks': "
                    "True} for a folder made of links)") from exc
            raise storage_error(exc, "read", path) from exc

    def sync(self, names: Iterable[str]) -> None:
        folders = {self.path}
        for name in names:
            path = self._full(name)
            self._refuse_links(path, "sync")
            folders.add(os.path.dirname(path))
            try:
                fd = self.fs.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
            except OSError as exc:
                raise storage_error(exc, "open", path) from exc
            try:
                self.fs.fsync(fd)
            except OSError as exc:
                if exc.errno not in _NO_DIR_FSYNC:  # Windows refuses fsync of a read-only handle
                    raise storage_error(exc, "sync", path) from exc
            finally:
                self.fs.close(fd)
        for folder in sorted(folders, key=len, reverse=True):
            try:
                fsync_folder(folder, self.fs)
            except OSError as exc:
                raise storage_error(exc, "sync the folder", folder) from exc

    def listdir(self) -> dict[str, int | None]:
        follow = self.follow_symlinks
        out: dict[str, int | None] = {}
        if not self._is_inside():
            return out  # reached through a symlink: nothing here is part of a checkpoint
        try:
            with self.fs.scandir(self.path) as it:
                for e in it:
                    try:
                        if e.is_dir(follow_symlinks=follow):
                            out[e.name] = None
                        elif e.is_file(follow_symlinks=follow):  # FIFOs, sockets, devices: left out
                            out[e.name] = e.stat(follow_symlinks=follow).st_size
                    except FileNotFoundError:
                        continue  # deleted while listed (retention, an overwrite): not there
            return out
        except (FileNotFoundError, NotADirectoryError):
            return {}
        except OSError as exc:
            raise storage_error(exc, "list", self.path) from exc

    def delete(self, names: Iterable[str]) -> None:
        folders = set()
        for name in names:
            path = self._full(name)
            self._refuse_links(path, "delete")
            try:
                self.fs.unlink(path)
            except FileNotFoundError:
                continue
            except OSError as exc:
                raise storage_error(exc, "delete", path) from exc
            folders.add(os.path.dirname(path))
        for folder in folders:
            try:
                fsync_folder(folder, self.fs)
            except OSError as exc:
                raise storage_error(exc, "sync the folder", folder) from exc

    def rename(self, src: str, dst: str) -> None:
        path = self._full(dst)
        self._refuse_links(self._full(src), "rename")
        self._refuse_links(path, "rename into")
        try:
            self.fs.replace(self._full(src), path)
            fsync_folder(os.path.dirname(path), self.fs)
        except OSError as exc:
            raise storage_error(exc, "rename into", path) from exc

    def open_replace(self, name: str) -> Replacement:
        return _LocalReplacement(self, name)

    def remove_folder(self) -> None:
        self._refuse_links(os.path.join(self.path, "x"), "remove")
        try:
            self.fs.rmdir(self.path)
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                return
            raise storage_error(exc, "remove folder", self.path) from exc
        try:
            fsync_folder(os.path.dirname(self.path), self.fs)
        except OSError as exc:
            raise storage_error(exc, "sync the folder of", self.path) from exc


class _LocalReplacement(Replacement):
    """A replacement of one file on a local or network filesystem (module docstring)."""

    def __init__(self, storage: LocalStorage, name: str) -> None:
        self.fs = fs = storage.fs
        self.path = path = storage._full(name)
        self.folder = folder = os.path.dirname(path)
        self.temp = os.path.join(folder, os.path.basename(replace_temp_name(name)))
        self.written = 0
        self._gathered = bytearray()
        self.fd: int | None = None
        storage._refuse_links(path, "replace")
        try:
            storage._ensure_folder(folder)
            self._remove_leftovers()
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
            self.fd = fs.open(self.temp, flags, 0o666)
        except OSError as exc:
            raise storage_error(exc, "create", self.temp) from exc
        self._writeback = _Writeback(fs, self.fd)

    def _remove_leftovers(self) -> None:
        """Temporary files of replacements of this name that a killed process left."""
        base = os.path.basename(self.path)
        try:
            with self.fs.scandir(self.folder) as entries:
                stale = [e.name for e in entries if is_replace_temp(e.name, base)]
        except FileNotFoundError:
            return
        for name in stale:
            try:
                self.fs.unlink(os.path.join(self.folder, name))
            except FileNotFoundError:
                pass

    def write(self, data: Buffer) -> int:
        view = memoryview(data).cast("B")
        n = len(view)
        if self.fd is None:
            raise ValueError(f"write to a finished replacement of {self.path}")
        try:
            if len(self._gathered) + n > _GATHER:
                self._drain()
            if n >= _GATHER:
                _write_all(self.fs, self.fd, view)
                self._writeback.wrote(n)
            else:
                self._gathered += view
        except OSError as exc:
            raise storage_error(exc, "write", self.temp) from exc
        self.written += n
        return n

    def _drain(self) -> None:
        if self._gathered and self.fd is not None:
            gathered, self._gathered = self._gathered, bytearray()
            _write_all(self.fs, self.fd, gathered)
            self._writeback.wrote(len(gathered))

    def commit(self) -> int:
        fs = self.fs
        try:
            try:
                self._drain()
                assert self.fd is not None
                fs.fsync(self.fd)  # durable before it is visible
            finally:
                fd, self.fd = self.fd, None
                if fd is not None:
                    fs.close(fd)
            self._put_in_place()
            if not fsync_folder(self.folder, fs):
                self._flush_again()
        except OSError as exc:
            self.abort()
            raise storage_error(exc, "replace", self.path) from exc
        return self.written

    def _put_in_place(self) -> None:
        for delay in (*REPLACE_RETRY_DELAYS, None):
            try:
                self.fs.replace(self.temp, self.path)
                return
            except PermissionError:
                if delay is None:
                    raise
                time.sleep(delay)
            except OSError as exc:
                if exc.errno not in _NO_RENAME:
                    raise
                self._copy_into_place()
                return

    def _copy_into_place(self) -> None:
        """The filesystem refuses rename: copy the complete temporary file under the
        final name (a FUSE mount of an object store shows the new object once it is
        closed), then remove the temporary one."""
        fs = self.fs
        block = bytearray(min(_COPY_BLOCK, max(self.written, 1)))
        with fs.open_reader(self.temp) as src:
            out = fs.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_BINARY", 0), 0o666)
            try:
                while True:
                    n = src.readinto(memoryview(block))
                    if not n:
                        break
                    _write_all(fs, out, memoryview(block)[:n])
                fs.fsync(out)
            finally:
                fs.close(out)
        fs.unlink(self.temp)

    def _flush_again(self) -> None:
        """The folder could not be fsynced (Windows): flush the new file once more, which
        commits the filesystem's metadata journal, the rename with it. Best effort."""
        try:
            fd = self.fs.open(self.path, os.O_WRONLY | getattr(os, "O_BINARY", 0))
        except OSError:
            return
        try:
            self.fs.fsync(fd)
        except OSError:
            pass
        finally:
            self.fs.close(fd)

    def abort(self) -> None:
        fd, self.fd = self.fd, None
        try:
            if fd is not None:
                self.fs.close(fd)
            self.fs.unlink(self.temp)
        except OSError:
            pass
