"""Local and network filesystems through POSIX (and Windows) file calls.

Durability: every file is fsynced before ``write_file`` returns, and so is its folder
(where the OS allows: Windows and some filesystems refuse folder fsync, which is then
skipped). Files are created with ``O_EXCL`` directly under their final name and the
process umask applies; nothing is staged elsewhere and the commit protocol renames
nothing (``rename`` is for exports, which put finished files in place).

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

import errno
import io
import os
import stat
from types import TracebackType
from typing import Any, Iterable, Protocol

from ..errors import CorruptCheckpointError
from .base import Buffer, Storage, storage_error
from .mounts import warn_if_fsync_is_weak

_NO_DIR_FSYNC = {errno.EINVAL, errno.ENOTSUP, errno.EBADF, errno.EACCES, errno.EPERM, errno.EISDIR}
_MAX_WRITE = 1 << 30


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


OS_FILESYSTEM = OSFileSystem()


def fsync_folder(path: str, fs: FileSystem | None = None) -> None:
    """Make a folder's entries durable; skipped where the platform cannot."""
    fs = fs or OS_FILESYSTEM
    if fs.name == "nt":
        return
    try:
        fd = fs.open(path, os.O_RDONLY)
    except OSError as exc:
        if exc.errno in _NO_DIR_FSYNC:
            return
        raise
    try:
        fs.fsync(fd)
    except OSError as exc:
        if exc.errno not in _NO_DIR_FSYNC:
            raise
    finally:
        fs.close(fd)


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
        if self.follow_symlinks:
            return True
        rel = os.path.relpath(os.path.dirname(path), self.anchor)
        if rel == ".":
            return True
        current = self.anchor
        for part in rel.split(os.sep):
            current = os.path.join(current, part)
            try:
                if not stat.S_ISDIR(self.fs.lstat(current).st_mode):
                    return False
            except FileNotFoundError:
                return True  # nothing below a missing folder can be read either
            except OSError:
                return False
        return True

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
        try:
            self._ensure_folder(os.path.dirname(path))
            if fs is OS_FILESYSTEM:
                warn_if_fsync_is_weak(os.path.dirname(path))
            fd = fs.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
        except FileExistsError:
            raise
        except OSError as exc:
            raise storage_error(exc, "create", path) from exc
        try:
            for part in parts:
                _write_all(fs, fd, part)
                written += len(part)
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
                    if e.is_dir(follow_symlinks=follow):
                        out[e.name] = None
                    elif e.is_file(follow_symlinks=follow):  # FIFOs, sockets, devices: left out
                        out[e.name] = e.stat(follow_symlinks=follow).st_size
            return out
        except (FileNotFoundError, NotADirectoryError):
            return {}
        except OSError as exc:
            raise storage_error(exc, "list", self.path) from exc

    def delete(self, names: Iterable[str]) -> None:
        folders = set()
        for name in names:
            path = self._full(name)
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
        try:
            self.fs.replace(self._full(src), path)
            fsync_folder(os.path.dirname(path), self.fs)
        except OSError as exc:
            raise storage_error(exc, "rename into", path) from exc

    def remove_folder(self) -> None:
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
