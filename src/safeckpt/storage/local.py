"""Local and network filesystems through POSIX (and Windows) file calls.

Durability: every file is fsynced before ``write_file`` returns, and so is its folder
(where the OS allows: Windows and some filesystems refuse folder fsync, which is then
skipped). Files are created with ``O_EXCL`` directly under their final name and the
process umask applies; nothing is staged elsewhere and the commit protocol renames
nothing (``rename`` is for exports, which put finished files in place).

Every OS call goes through a small file-system object (``fs``), by default
``OS_FILESYSTEM``, which calls the ``os`` module at call time (so tests that
monkeypatch ``os.fsync`` and friends still reach this code). ``safeckpt.testing``
passes a simulated disk instead to crash and power-cut saves on purpose.
"""

from __future__ import annotations

import errno
import os
from typing import IO, Any, Iterable

from .base import Buffer, Storage, storage_error

_NO_DIR_FSYNC = {errno.EINVAL, errno.ENOTSUP, errno.EBADF, errno.EACCES, errno.EPERM, errno.EISDIR}
_MAX_WRITE = 1 << 30


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

    def open_reader(self, path: str) -> IO[bytes]:
        """An unbuffered binary file with ``seek`` and ``readinto``."""
        return open(path, "rb", buffering=0)

    def replace(self, src: str, dst: str) -> None:
        os.replace(src, dst)


OS_FILESYSTEM = OSFileSystem()


def fsync_folder(path: str, fs: OSFileSystem | None = None) -> None:
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


def _write_all(fs: OSFileSystem, fd: int, data: Buffer) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = fs.write(fd, view[:_MAX_WRITE])
        view = view[n:]


class LocalStorage(Storage):
    """A folder on a local or network filesystem.

    ``fs`` replaces the OS calls (default: the real ``os``); see ``OSFileSystem``."""

    atomic_write = False  # a reader may see a file before it is complete
    can_rename = True

    def __init__(self, path: str | os.PathLike, fs: OSFileSystem | None = None) -> None:
        self.fs = fs if fs is not None else OS_FILESYSTEM
        self.path = os.path.abspath(os.fspath(path))
        self.url = self.path

    def _full(self, name: str) -> str:
        return os.path.join(self.path, *name.split("/"))

    def child(self, name: str) -> "LocalStorage":
        return LocalStorage(self._full(name), fs=self.fs)

    def parent(self) -> "LocalStorage":
        return LocalStorage(os.path.dirname(self.path), fs=self.fs)

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
            with self.fs.open_reader(path) as f:
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
            raise storage_error(exc, "read", path) from exc

    def listdir(self) -> dict[str, int | None]:
        try:
            with self.fs.scandir(self.path) as it:
                return {e.name: None if e.is_dir() else e.stat().st_size for e in it}
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
