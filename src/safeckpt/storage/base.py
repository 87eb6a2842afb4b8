"""The ``Storage`` interface: the handful of operations the commit protocol needs.

A ``Storage`` is a folder on some backend; names are ``/``-separated paths relative
to it. Files are written once under their final name and never modified; nothing
here needs rename. Capability flags tell the protocol what the backend can do.
"""

from __future__ import annotations

import copy
import errno
from abc import ABC, abstractmethod
from typing import Iterable

from ..errors import StorageError
from ..format.names import is_shared, shared_location

Buffer = bytes | bytearray | memoryview


class Storage(ABC):
    """A folder of immutable files on one backend."""

    #: a reader can never observe a partly written file under its final name
    atomic_write: bool = False
    #: ``write_file(..., exclusive=True)`` is enforced by the backend, not just checked first
    exclusive_create: bool = True
    #: adjacent reads smaller than this are merged into one request (object stores pay a
    #: round trip per request, local disks only a system call)
    merge_reads_below: int = 1 << 20
    #: ``rename`` replaces a file atomically (never needed by the commit protocol; exports
    #: use it to put finished files in place)
    can_rename: bool = False

    url: str

    @abstractmethod
    def child(self, name: str) -> "Storage":
        """The storage of a sub-folder."""

    @abstractmethod
    def write_file(self, name: str, parts: Iterable[Buffer]) -> int:
        """Create ``name`` (which must not exist) from ``parts``; durable on return.

        Returns the number of bytes written. Raises ``FileExistsError`` if the name
        exists, ``StorageError`` for anything the backend refuses."""

    @abstractmethod
    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        """Fill ``out`` with the bytes of ``name`` from ``offset``; short files raise."""

    def sync(self, names: Iterable[str]) -> None:
        """Make files that already exist (another tool wrote them) durable, with their
        folders, before a manifest vouches for them. Object stores need nothing: an
        object is durable when its PUT returns."""

    @abstractmethod
    def listdir(self) -> dict[str, int | None]:
        """Entries directly in this folder: file name -> size, sub-folder -> None.

        A missing folder lists as empty."""

    @abstractmethod
    def delete(self, names: Iterable[str]) -> None:
        """Delete files (missing ones are fine); the deletion is durable on return."""

    @abstractmethod
    def remove_folder(self) -> None:
        """Remove this folder if it is empty (a no-op where folders are implicit)."""

    def rename(self, src: str, dst: str) -> None:
        """Atomically replace ``dst`` by ``src`` (durable on return), where ``can_rename``."""
        raise StorageError(f"{self.url}: this storage cannot rename files")

    def parent(self) -> "Storage":
        """The folder holding this one (incremental checkpoints read their siblings' data)."""
        raise StorageError(f"{self.url}: this storage cannot reach its parent folder, which an "
                           "incremental checkpoint needs to read data it shares with older ones")

    def locate(self, name: str) -> tuple["Storage", str]:
        """The folder and name of a file a manifest names: ``../<folder>/<file>`` is a file
        of a sibling checkpoint (written by an earlier save of an incremental run)."""
        if is_shared(name):
            folder, file = shared_location(name)
            return self.parent().child(folder), file
        return self, name

    def read(self, name: str, offset: int = 0, size: int | None = None) -> bytes:
        """Read ``size`` bytes (default: to the end) of ``name`` from ``offset``."""
        if size is None:
            size = self.size(name) - offset
        out = bytearray(size)
        self.read_into(name, offset, memoryview(out))
        return bytes(out)

    def size(self, name: str) -> int:
        """The size of a file; ``FileNotFoundError`` if it does not exist."""
        here, name = self.locate(name)
        head, _, tail = name.rpartition("/")
        folder = here.child(head) if head else here
        size = folder.listdir().get(tail)
        if size is None:
            raise FileNotFoundError(errno.ENOENT, "no such file", f"{self.url}/{name}")
        return size


class StorageWrapper(Storage):
    """A storage that forwards everything to ``inner``: a base for wrappers that change
    one thing (count the bytes read, hook writes). ``wrap(inner)`` makes the wrapper of
    a child or parent folder; the default copies this wrapper around the new inner."""

    def __init__(self, inner: Storage) -> None:
        self.inner = inner
        self.url = inner.url
        self.atomic_write = inner.atomic_write
        self.exclusive_create = inner.exclusive_create
        self.merge_reads_below = inner.merge_reads_below
        self.can_rename = inner.can_rename

    def wrap(self, inner: Storage) -> "StorageWrapper":
        clone = copy.copy(self)
        StorageWrapper.__init__(clone, inner)
        return clone

    def child(self, name: str) -> Storage:
        return self.wrap(self.inner.child(name))

    def parent(self) -> Storage:
        return self.wrap(self.inner.parent())

    def write_file(self, name: str, parts: Iterable[Buffer]) -> int:
        return self.inner.write_file(name, parts)

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        self.inner.read_into(name, offset, out)

    def listdir(self) -> dict[str, int | None]:
        return self.inner.listdir()

    def delete(self, names: Iterable[str]) -> None:
        self.inner.delete(names)

    def remove_folder(self) -> None:
        self.inner.remove_folder()

    def rename(self, src: str, dst: str) -> None:
        self.inner.rename(src, dst)

    def __getattr__(self, attr: str):  # backend extras, such as abort_stale_uploads
        if attr == "inner":
            raise AttributeError(attr)
        return getattr(self.inner, attr)


_REASONS = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EROFS: "the filesystem is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EIO: "an I/O error (the device may be failing)",
}


def storage_error(exc: OSError, action: str, where: str) -> StorageError:
    """Translate an ``OSError`` into a ``StorageError`` that says what, where and why."""
    reason = _REASONS.get(exc.errno or 0, exc.strerror or str(exc))
    err = StorageError(f"cannot {action} {where}: {reason} [{type(exc).__name__}: {exc}]")
    err.errno = exc.errno
    return err
