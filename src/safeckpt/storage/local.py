"""Local and network filesystems through POSIX (and Windows) file calls.

Durability: every file is fsynced before ``write_file`` returns, and so is its folder
(where the OS allows: Windows and some filesystems refuse folder fsync, which is then
skipped). Files are created with ``O_EXCL`` directly under their final name and the
process umask applies; nothing is staged elsewhere and nothing is renamed.
"""

from __future__ import annotations

import errno
import os
from typing import Iterable

from .base import Buffer, Storage, storage_error

_NO_DIR_FSYNC = {errno.EINVAL, errno.ENOTSUP, errno.EBADF, errno.EACCES, errno.EPERM, errno.EISDIR}
_MAX_WRITE = 1 << 30


def fsync_folder(path: str) -> None:
    """Make a folder's entries durable; skipped where the platform cannot."""
    if os.name == "nt":
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        if exc.errno in _NO_DIR_FSYNC:
            return
        raise
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in _NO_DIR_FSYNC:
            raise
    finally:
        os.close(fd)


def _write_all(fd: int, data: Buffer) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.write(fd, view[:_MAX_WRITE])
        view = view[n:]


class LocalStorage(Storage):
    """A folder on a local or network filesystem."""

    atomic_write = False  # a reader may see a file before it is complete

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.path.abspath(os.fspath(path))
        self.url = self.path

    def _full(self, name: str) -> str:
        return os.path.join(self.path, *name.split("/"))

    def child(self, name: str) -> "LocalStorage":
        return LocalStorage(self._full(name))

    def _ensure_folder(self, folder: str) -> None:
        if os.path.isdir(folder):
            return
        parent = os.path.dirname(folder)
        self._ensure_folder(parent)
        try:
            os.mkdir(folder)
        except FileExistsError:
            return
        fsync_folder(parent)

    def write_file(self, name: str, parts: Iterable[Buffer]) -> int:
        path = self._full(name)
        written = 0
        try:
            self._ensure_folder(os.path.dirname(path))
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
        except FileExistsError:
            raise
        except OSError as exc:
            raise storage_error(exc, "create", path) from exc
        try:
            for part in parts:
                _write_all(fd, part)
                written += len(part)
            os.fsync(fd)  # on EIO: fail the save, never retry (the pages may be gone)
        except OSError as exc:
            raise storage_error(exc, "write", path) from exc
        finally:
            os.close(fd)
        try:
            fsync_folder(os.path.dirname(path))
        except OSError as exc:
            raise storage_error(exc, "sync the folder of", path) from exc
        return written

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        path = self._full(name)
        try:
            with open(path, "rb", buffering=0) as f:
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
            with os.scandir(self.path) as it:
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
                os.unlink(path)
            except FileNotFoundError:
                continue
            except OSError as exc:
                raise storage_error(exc, "delete", path) from exc
            folders.add(os.path.dirname(path))
        for folder in folders:
            fsync_folder(folder)

    def remove_folder(self) -> None:
        try:
            os.rmdir(self.path)
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                return
            raise storage_error(exc, "remove folder", self.path) from exc
        fsync_folder(os.path.dirname(self.path))
